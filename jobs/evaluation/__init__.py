"""Held-out evaluation of adapter versions: which prompts (never trained on), how they are sampled, how they are
scored and summarised. A LoRA name pins a weight version, so an evaluation of v12 is exactly v12.

The pieces are the jobs' so that every place that evaluates uses them alike: the trainer (which prompts it must not
train on), the panel's local evaluator, and the evaluators still to come (beside the proxy during a run, in a replica
job on HF Jobs after it).
"""
