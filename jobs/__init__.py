"""Code that runs inside a job (trainer, replica, evaluator, smoke test); imports nothing from app/ or backend/."""
