import sys

from jobs.evaluation.during_run import main

sys.exit(main())
