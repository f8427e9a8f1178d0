import sys

from jobs.trainer.job import main

if __name__ == "__main__":
    sys.exit(main())
