"""transformers' `TrainerCallback`, subclassed once, so that the trainer's callbacks are typed.

transformers is not analysed (pyproject: its values are Any to mypy), and strict mode refuses a class whose base is
Any; every callback of the trainer derives from this one instead of each carrying that refusal.
"""

from transformers import TrainerCallback


class Callback(TrainerCallback):  # type: ignore[misc]  # TrainerCallback is Any: transformers is not analysed
    """transformers' callback, with nothing added."""
