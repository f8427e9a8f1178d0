# The control panel's image: the same requirements file and the same command as `./scripts/panel`.
# Serves on port 7860 (0.0.0.0 inside a Hugging Face Space, which sets SPACE_ID); runs as uid 1000, as Spaces expect.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_DISABLE_TELEMETRY=1

RUN useradd --create-home --uid 1000 user
# libseccomp: the reward sandbox's system-call filter (a shared Space runs no user reward code without it).
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends libseccomp2 && rm -rf /var/lib/apt/lists/*
WORKDIR /home/user/app

# Dependencies first, so code changes rebuild in seconds. torch comes from the CPU index: the panel never needs CUDA
# (training runs on HF Jobs; the embedded demo runs on CPU).
COPY --chown=user requirements.txt requirements-jobs.txt requirements-reporting.txt ./
RUN pip install -r requirements.txt --extra-index-url https://download.pytorch.org/whl/cpu

# Only what runs: the UI, the backend and the job code (the embedded demo starts jobs as local processes).
COPY --chown=user app app
COPY --chown=user backend backend
COPY --chown=user jobs jobs
COPY --chown=user pyproject.toml .

USER user
# The panel's database, credential key and demo bucket live in GRPO_PANEL_DATA; point it at a mounted volume (a Space
# bucket volume, or `docker run -v`) to keep runs across restarts. The tiny demo model is built once into the cache.
ENV HOME=/home/user \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRPO_PANEL_DATA=/home/user/app/data \
    GRPO_MODEL_CACHE=/home/user/.cache/grpo-panel/models

EXPOSE 7860
CMD ["python", "-m", "app"]
