"""Adapters: every version a run published, what to do with one, and how two of them differ.

Versions never disappear from the bucket: making an old one current (a rollback) or training a branch from it keeps
every later version, so any choice here can be undone.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import gradio as gr
import pandas as pd
from huggingface_hub.errors import HfHubHTTPError

from app import cards
from app.actions import branch_from
from app.charts.adapters import norms_heatmap
from app.events import Components, Updates
from app.formatting import clock, number, size
from app.pages.monitor import run_choices
from app.panel import Panel
from backend.api import PanelServices
from backend.database.models import TERMINAL_STATUSES, VERSION_REWARD_STEPS, AdapterVersion, Run
from backend.services.adapters import Comparison
from backend.services.evaluation import Evaluation, PromptDifference
from backend.services.queries import HeldOutScore
from backend.services.runs import RunStateError, propose_run_id
from jobs.evaluation.results import TOTAL, VersionEval

REFRESH_SECONDS = 5.0
PICK_FIRST = "Pick a run and a version first (click a row of the table)."
# A version's reward is a mean over the steps up to its own (backend.ingestion.ingest.version_reward): said in its
# heading, so that it is not read as the header's latest (one-step) reward.
REWARD_COLUMN = f"reward ({VERSION_REWARD_STEPS}-step mean)"
HELD_OUT_COLUMN = "held-out"
COLUMNS = ["version", "step", REWARD_COLUMN, HELD_OUT_COLUMN, "size", "saved", "alias", "policy audit"]


def versions_table(
    run: Run | None, versions: list[AdapterVersion], held_out: list[HeldOutScore] | None = None
) -> pd.DataFrame:
    """Newest first, with each version's held-out reward where it was evaluated (the `best` alias goes by it)."""
    scores = {score.version: score for score in held_out or []}
    rows = []
    for v in reversed(versions):
        alias = []
        if run is not None and v.version == run.current_version:
            alias.append("● current")
        if run is not None and v.version == run.best_version:
            alias.append("★ best")
        audit = "—" if v.audit_ok is None else ("✓ agree" if v.audit_ok else "✗ differ")
        rows.append(
            {
                "version": f"v{v.version}",
                "step": v.step,
                REWARD_COLUMN: round(v.reward, 3) if v.reward is not None else None,
                HELD_OUT_COLUMN: held_out_text(scores.get(v.version)),
                "size": size(v.size_bytes),
                "saved": clock(v.created_at),
                "alias": " ".join(alias),
                "policy audit": audit,
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def held_out_text(score: HeldOutScore | None) -> str:
    """A held-out reward as mean ± half its 95 % interval (∞: unbounded, one prompt); "—": not evaluated."""
    if score is None:
        return "—"
    half = f"{score.half_width:.3f}" if score.half_width is not None else "∞"
    return f"{score.mean:.3f} ± {half}"


def version_choices(run: Run, versions: list[AdapterVersion], held_out: list[HeldOutScore]) -> list[tuple[str, int]]:
    """The versions to pick from, newest first, the `best` alias first of all and said as such: by held-out reward
    once versions are evaluated, else by training reward."""
    evaluated = {score.version for score in held_out}
    by = "best by eval" if run.best_version in evaluated else "best by training reward"
    choices = [
        (f"v{v.version} · step {v.step}" + (f" · {by}" if v.version == run.best_version else ""), v.version)
        for v in reversed(versions)
    ]
    return sorted(choices, key=lambda choice: choice[1] != run.best_version)  # stable: the rest stay newest first


def metrics_table(comparison: Comparison) -> pd.DataFrame:
    rows = []
    for name, (a, b) in comparison.metrics.items():
        change = f"{b - a:+.4g}" if a is not None and b is not None else "—"
        rows.append(
            {
                "metric": name,
                f"v{comparison.version_a}": number(a, 4),
                f"v{comparison.version_b}": number(b, 4),
                "change": change,
            }
        )
    return pd.DataFrame(rows)


def differences_table(rows: list[PromptDifference], a: int, b: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt": [row.prompt for row in rows],
            f"v{a} score": [round(row.score_a, 3) for row in rows],
            f"v{b} score": [round(row.score_b, 3) for row in rows],
            f"v{a} says": [row.completion_a for row in rows],
            f"v{b} says": [row.completion_b for row in rows],
        }
    )


def best_evaluated(results: list[VersionEval]) -> VersionEval:
    """The highest held-out reward, as the `best` alias goes: the base model (v0) is no version to keep, unless it is
    all that was evaluated."""
    kept = [result for result in results if result.version] or results
    return max(kept, key=lambda result: result.summary(TOTAL).avg.mean)


def evaluated_table(evaluation: Evaluation, steps: dict[int, int | None], best: int) -> pd.DataFrame:
    """One row per evaluated version, in the order asked: each score as mean ± half its 95 % interval (pass@k too
    where every score is 0 or 1), whether it was read back, and the best by held-out reward marked."""
    rows = []
    for result, cached in zip(evaluation.results, evaluation.cached, strict=True):
        row: dict[str, object] = {
            "version": f"v{result.version}" + (" ★ best" if result.version == best else ""),
            "step": 0 if result.version == 0 else steps.get(result.version),
        }
        for name in result.scores:
            summary = result.summary(name)
            row[name] = f"{summary.avg.mean:.3f} ± {summary.avg.half_width:.3f}"
            if summary.pass_at_k is not None:
                row[f"{name} pass@{result.k}"] = round(summary.pass_at_k, 3)
        row["scored"] = "read back" if cached else f"in {result.seconds:.0f} s"
        rows.append(row)
    return pd.DataFrame(rows)


def _picked_version(event: gr.SelectData) -> int:
    """The version of the clicked row of the versions table (its first cell reads 'v3')."""
    return int(str(event.row_value[0]).lstrip("v"))


class AdaptersPage:
    def __init__(self, panel: Panel):
        self.panel = panel
        # Zips are handed to Gradio from here: a temp folder it may serve from, wherever the data folder is mounted.
        self.downloads = Path(tempfile.mkdtemp(prefix="grpo-panel-downloads-"))
        self._cancelled: set[tuple[str, str]] = set()  # (owner, run id) whose held-out evaluation job is to end

    def build(self) -> None:
        with gr.Row(elem_classes="gp-align-end"):
            self.run = gr.Dropdown([], label="Run", elem_id="adapters-run", scale=3)
            self.lineage = gr.HTML("", elem_id="adapters-lineage", padding=False)
        with gr.Row():
            with gr.Column(scale=4):  # wide enough at 1400 px for the last column, the policy audit (it was cut)
                self.table = gr.Dataframe(
                    versions_table(None, []),
                    interactive=False,
                    elem_id="versions-table",
                    label="Adapter versions, newest first (click one to select it)",
                    max_height=360,
                    wrap=True,  # eight columns: headers and values wrap rather than push the audit out of sight
                )
            with gr.Column(scale=2), gr.Group():
                self.version = gr.Dropdown([], label="Selected version", elem_id="adapters-version")
                with gr.Row():
                    self.prepare_button = gr.Button("Download zip", elem_id="prepare-download")
                    self.current_button = gr.Button("Make current (roll back)", elem_id="make-current")
                self.download = gr.DownloadButton(
                    "Save the zip", visible=False, elem_id="download-zip", variant="primary"
                )
                with gr.Row(elem_classes="gp-align-end"):
                    self.branch_id = gr.Textbox(
                        propose_run_id(self.panel.ctx, "branch"), label="Branch run id", elem_id="branch-id"
                    )
                    self.branch_now = gr.Checkbox(True, label="Start training now", elem_id="branch-now")
                self.branch_button = gr.Button(
                    "Train a branch from here", elem_id="branch", variant="primary", interactive=False
                )
                with gr.Row(elem_classes="gp-align-end"):
                    self.repo = gr.Textbox(label="Hub model repo", placeholder="your-name/my-adapter")
                    self.private = gr.Checkbox(True, label="Private repo")
                self.publish_button = gr.Button("Publish to Hub (with a model card)", elem_id="publish")
        self.action = gr.HTML("", elem_id="adapters-action", padding=False)

        gr.Markdown("### Compare two versions", elem_classes="gp-section-title")
        with gr.Row(elem_classes="gp-align-end"):
            self.version_a = gr.Dropdown([], label="Version A (before)", elem_id="compare-a")
            self.version_b = gr.Dropdown([], label="Version B (after)", elem_id="compare-b")
            self.compare_button = gr.Button("Compare", elem_id="compare", variant="primary")
        self.summary = gr.HTML("", elem_id="compare-summary", padding=False)
        self.heatmap = gr.Plot(norms_heatmap(None), show_label=False, elem_id="norms-heatmap")
        self.metrics = gr.Dataframe(
            visible=False, interactive=False, label="Metrics at both steps", elem_id="compare-metrics"
        )
        with gr.Row(elem_classes="gp-align-end"):
            self.prompts = gr.Textbox(
                lines=2,
                scale=4,
                label="Prompts to generate with both versions (one per line)",
                placeholder="Write some numbers. apple",
            )
            self.generate_button = gr.Button("Generate side by side", elem_id="generate", scale=1)
        with gr.Row(elem_classes="gp-align-end"):
            gr.HTML(
                '<span class="gp-meta">Score A and B on the run\'s held-out prompts (never trained on), on the '
                "same seeded draws, with the run's rewards; kept in the bucket, so asking again is instant. A run on "
                "HF Jobs is scored by one job there, at its replicas' price (Cancel ends it).</span>",
                padding=False,
            )
            self.held_out_button = gr.Button(
                "Compare on held-out prompts", elem_id="compare-held-out", scale=0, min_width=240
            )
            # A run on HF Jobs is evaluated by a job there: this cancels it (and it stops billing).
            self.held_out_cancel = gr.Button("Cancel", elem_id="cancel-held-out", scale=0, min_width=100)
        self.held_out_summary = gr.HTML("", elem_id="held-out-summary", padding=False)
        self.held_out_table = gr.Dataframe(
            visible=False,
            interactive=False,
            wrap=True,
            label="Where they differ most (first sample of each)",
            elem_id="held-out-differences",
        )
        gr.Markdown("### Evaluate versions on held-out prompts", elem_classes="gp-section-title")
        with gr.Row(elem_classes="gp-align-end"):
            self.evaluated_words = gr.Textbox(
                "0 best-reward last",
                label="Versions",
                info="numbers (0: the base model), last, all, every:N (every Nth and the last), best-reward (the "
                "highest training reward)",
                elem_id="evaluate-versions-words",
                scale=4,
            )
            self.evaluate_button = gr.Button(
                "Evaluate", elem_id="evaluate-versions", variant="primary", scale=0, min_width=160
            )
            self.evaluate_cancel = gr.Button("Cancel", elem_id="cancel-evaluate", scale=0, min_width=100)
        self.evaluated_summary = gr.HTML("", elem_id="evaluated-summary", padding=False)
        self.evaluated_table = gr.Dataframe(
            visible=False,
            interactive=False,
            wrap=True,
            label="Held-out scores, mean ± half the 95 % interval (under the run's own eval settings they also fill "
            "the versions table)",
            elem_id="evaluated-versions",
        )
        self.generations = gr.Dataframe(
            visible=False,
            interactive=False,
            wrap=True,
            label="Generations (greedy, 64 tokens)",
            column_widths=["20%", "40%", "40%"],
            elem_id="generations",
        )
        self.listed = gr.State(None)  # what the versions list shows: ticks update it only when that changes
        self.timer = gr.Timer(REFRESH_SECONDS, active=False)
        self._wire()

    def _listing_outputs(self) -> Components:
        return [self.lineage, self.table, self.version, self.version_a, self.version_b, self.listed]

    def _wire(self) -> None:
        self.run.change(self.show_run, [self.run], [*self._listing_outputs(), self.download])
        self.timer.tick(self.refresh, [self.run, self.listed], self._listing_outputs(), show_progress="hidden")
        self.table.select(_picked_version, None, self.version)
        self.version.change(_version_picked, [self.version], [self.download, self.branch_button])
        self.prepare_button.click(self.prepare_download, [self.run, self.version], [self.download, self.action])
        self.current_button.click(self.make_current, [self.run, self.version], [self.action]).then(
            self.refresh, [self.run], self._listing_outputs()
        )
        self.publish_button.click(self.publish, [self.run, self.version, self.repo, self.private], [self.action])
        self.compare_button.click(
            self.compare, [self.run, self.version_a, self.version_b], [self.summary, self.heatmap, self.metrics]
        )
        self.held_out_button.click(
            self.compare_held_out,
            [self.run, self.version_a, self.version_b],
            [self.held_out_summary, self.held_out_table],
            concurrency_limit=1,
            concurrency_id="generate",
        )
        self.held_out_cancel.click(self.cancel_held_out, [self.run], None)
        self.evaluate_button.click(
            self.evaluate_named,
            [self.run, self.evaluated_words],
            [self.evaluated_summary, self.evaluated_table],
            concurrency_limit=1,
            concurrency_id="generate",
        ).then(self.refresh, [self.run, self.listed], self._listing_outputs(), show_progress="hidden")
        self.evaluate_cancel.click(self.cancel_held_out, [self.run], None)
        self.generate_button.click(
            self.generate,
            [self.run, self.version_a, self.version_b, self.prompts],
            [self.generations],
            concurrency_limit=1,
            concurrency_id="generate",
        )

    # --- handlers -----------------------------------------------------------------------------------------------

    def open(self, run_id: str | None, current: str | None, profile: gr.OAuthProfile | None = None) -> Updates:
        """The page was opened: list the owner's runs, keeping the one shown (or the monitor's) selected, and
        propose a free id for a branch (the last one proposed may have been used since)."""
        choices = run_choices(self.panel.services_or_none(profile))
        ids = [value for _, value in choices]
        value = current if current in ids else (run_id if run_id in ids else (ids[0] if ids else None))
        return {
            self.run: gr.Dropdown(choices=choices, value=value),
            self.branch_id: propose_run_id(self.panel.ctx, "branch"),
        }

    def show_run(self, run_id: str | None, profile: gr.OAuthProfile | None = None) -> Updates:
        """A run was picked: list its versions and preselect the current one, and the pair to compare."""
        services = self.panel.services_or_none(profile)
        if services is None or not run_id:
            empty = gr.Dropdown(choices=[], value=None)
            return {
                self.lineage: cards.empty_state("Pick a run to see its adapter versions."),
                self.table: versions_table(None, []),
                **{picker: empty for picker in (self.version, self.version_a, self.version_b)},
                self.download: gr.DownloadButton(visible=False),
                self.listed: None,
            }
        run = services.runs.get(run_id)
        versions = services.adapters.versions(run_id)
        listing, choices = self._listing(services, run, versions)
        latest = versions[-1].version if versions else None
        trained = [v.version for v in versions if v.step and v.version != latest]  # skip the untrained initial one
        first = trained[0] if trained else (versions[0].version if versions else None)
        # An ended run is looked at to pick the version to keep: its best is offered first (current while it trains).
        best = run.best_version if run.status in TERMINAL_STATUSES else None
        chosen = best or (run.current_version if run.current_version is not None else latest)
        return listing | {
            self.version: gr.Dropdown(choices=choices, value=chosen),
            self.version_a: gr.Dropdown(choices=choices, value=first),
            self.version_b: gr.Dropdown(choices=choices, value=latest),
            self.download: gr.DownloadButton(visible=False),
        }

    def refresh(
        self, run_id: str | None, listed: list[object] | None = None, profile: gr.OAuthProfile | None = None
    ) -> Updates:
        """A tick: when versions were added (or an alias moved), update the list, keeping every selection."""
        # "Nothing changed" names one output: Gradio takes an empty dict for a single value and fails the tick.
        unchanged: Updates = {self.listed: gr.skip()}
        services = self.panel.services_or_none(profile)
        if services is None or not run_id:
            return unchanged
        run = services.runs.get(run_id)
        versions = services.adapters.versions(run_id)
        listing, choices = self._listing(services, run, versions)
        if listing[self.listed] == listed:
            return unchanged
        return listing | {
            picker: gr.Dropdown(choices=choices) for picker in (self.version, self.version_a, self.version_b)
        }

    def _listing(
        self, services: PanelServices, run: Run, versions: list[AdapterVersion]
    ) -> tuple[Updates, list[tuple[str, int]]]:
        """The lineage, the versions table and what they were drawn from; the versions as choices."""
        children = [r for r in services.runs.list() if r.parent_run_id == run.id]
        lineage = cards.lineage(run, children)
        if not versions:
            lineage += cards.empty_state(
                "No adapter version yet: the trainer publishes one at every weight sync; they appear here within "
                "seconds."
            )
        held_out = services.queries.held_out_series(run.id)
        key = [run.id, [v.version for v in versions], run.current_version, run.best_version,
               [(c.id, c.status) for c in children], [(s.version, s.mean) for s in held_out]]  # fmt: skip
        table = versions_table(run, versions, held_out)
        return {self.lineage: lineage, self.table: table, self.listed: key}, version_choices(run, versions, held_out)

    def prepare_download(
        self, run_id: str | None, version: int | None, profile: gr.OAuthProfile | None = None
    ) -> Updates:
        services = self.panel.services(profile)
        if not run_id or version is None:  # said beside the buttons, where the last outcome is, not in a toast
            return {self.download: gr.DownloadButton(visible=False), self.action: cards.note(PICK_FIRST, "warn")}
        path = Path(shutil.copy(services.adapters.download_zip(run_id, int(version)), self.downloads))
        return {
            self.download: gr.DownloadButton(
                f"Save {path.name} ({size(path.stat().st_size)})", value=str(path), visible=True
            ),
            self.action: cards.note(
                f"v{version} fetched from the bucket and checked against its manifest: press Save.", "good"
            ),
        }

    def make_current(self, run_id: str | None, version: int | None, profile: gr.OAuthProfile | None = None) -> str:
        services = self.panel.services(profile)
        if not run_id or version is None:
            return cards.note(PICK_FIRST, "warn")
        services.adapters.make_current(run_id, int(version))
        return cards.note(f"v{version} is now the current adapter of {run_id}; later versions are kept.", "good")

    def branch(
        self,
        run_id: str | None,
        version: int | None,
        new_id: str,
        start_now: bool,
        profile: gr.OAuthProfile | None = None,
    ) -> str:
        """Make `version` current and start a child run from it; returns the child's id."""
        return branch_from(self.panel.services(profile), run_id, version, new_id, start_now, PICK_FIRST)

    def publish(
        self, run_id: str | None, version: int | None, repo: str, private: bool, profile: gr.OAuthProfile | None = None
    ) -> str:
        """The outcome replaces the last one shown beside the buttons (a success never stays beside a failure)."""
        services = self.panel.services(profile)
        if not run_id or version is None or not (repo or "").strip():
            return cards.note("Pick a version and name the Hub repo (owner/name) first.", "warn")
        try:
            url = services.adapters.publish(run_id, int(version), repo.strip(), private=bool(private))
        except (RunStateError, HfHubHTTPError) as error:  # no token, no write access, a repo name the Hub refuses
            return cards.note(f"Not published: {error}", "bad")
        return cards.note(f"Published v{version} with a model card: {url}", "good")

    def compare(
        self, run_id: str | None, version_a: int | None, version_b: int | None, profile: gr.OAuthProfile | None = None
    ) -> Updates:
        services = self.panel.services(profile)
        if not run_id or version_a is None or version_b is None:
            return {self.summary: cards.note("Pick two versions to compare (A and B above).", "warn")}
        comparison = services.adapters.compare(run_id, int(version_a), int(version_b))
        return {
            self.summary: cards.comparison_stats(comparison),
            self.heatmap: norms_heatmap(comparison),
            self.metrics: gr.Dataframe(metrics_table(comparison), visible=True),
        }

    def cancel_held_out(self, run_id: str | None, profile: gr.OAuthProfile | None = None) -> None:
        if run_id:
            self._cancelled.add((self.panel.services(profile).owner, run_id))

    def compare_held_out(
        self,
        run_id: str | None,
        version_a: int | None,
        version_b: int | None,
        profile: gr.OAuthProfile | None = None,
        progress: gr.Progress = gr.Progress(),
    ) -> Updates:
        """Versions A and B scored on the run's held-out prompts: the paired difference, and where they differ most.
        A run on HF Jobs is evaluated by a job there; how it goes is shown as progress, and Cancel ends it."""
        services = self.panel.services(profile)
        hidden = gr.Dataframe(visible=False)
        if not run_id or version_a is None or version_b is None or int(version_a) == int(version_b):
            return {self.held_out_summary: cards.note("Pick two different versions (A and B above).", "warn"),
                    self.held_out_table: hidden}  # fmt: skip
        a, b = int(version_a), int(version_b)
        asked = (services.owner, run_id)
        self._cancelled.discard(asked)
        try:
            evaluation = services.evaluation.evaluate(
                run_id,
                [a, b],
                on_progress=lambda message: progress(None, desc=message),
                cancelled=lambda: asked in self._cancelled,
            )
        except ValueError as error:  # no held-out prompts, a version gone, an engine that failed: said in words
            return {self.held_out_summary: cards.note(f"Not evaluated: {error}", "bad"), self.held_out_table: hidden}
        return {
            self.held_out_summary: cards.held_out_comparison(evaluation, services.evaluation.compare(evaluation, a, b)),
            self.held_out_table: gr.Dataframe(
                differences_table(services.evaluation.differences(evaluation, a, b), a, b), visible=True
            ),
        }

    def evaluate_named(
        self,
        run_id: str | None,
        words: str,
        profile: gr.OAuthProfile | None = None,
        progress: gr.Progress = gr.Progress(),
    ) -> Updates:
        """The versions named by `words` scored on the run's held-out prompts, the best marked. A run on HF Jobs is
        evaluated by one job there; how it goes is shown as progress, and Cancel ends it."""
        services = self.panel.services(profile)
        hidden = gr.Dataframe(visible=False)
        if not run_id:
            return {self.evaluated_summary: cards.note("Pick a run first.", "warn"), self.evaluated_table: hidden}
        asked = (services.owner, run_id)
        self._cancelled.discard(asked)
        try:
            versions = services.evaluation.versions_named(run_id, (words or "").split())
            evaluation = services.evaluation.evaluate(
                run_id,
                versions,
                on_progress=lambda message: progress(None, desc=message),
                cancelled=lambda: asked in self._cancelled,
            )
        except ValueError as error:  # a word that names no version, no held-out prompts, an engine that failed
            return {self.evaluated_summary: cards.note(f"Not evaluated: {error}", "bad"), self.evaluated_table: hidden}
        best = best_evaluated(evaluation.results)
        steps = {version.version: version.step for version in services.adapters.versions(run_id)}
        return {
            self.evaluated_summary: cards.held_out_evaluation(evaluation, best),
            self.evaluated_table: gr.Dataframe(evaluated_table(evaluation, steps, best.version), visible=True),
        }

    def generate(
        self,
        run_id: str | None,
        version_a: int | None,
        version_b: int | None,
        prompts: str,
        profile: gr.OAuthProfile | None = None,
    ) -> gr.Dataframe:
        services = self.panel.services(profile)
        lines = [line.strip() for line in (prompts or "").splitlines() if line.strip()][:8]
        if not run_id or version_a is None or version_b is None or not lines:
            raise gr.Error("Pick two versions and type at least one prompt.")
        if int(version_a) == int(version_b):
            raise gr.Error("Pick two different versions to compare their generations.")
        versions = [int(version_a), int(version_b)]
        texts = services.adapters.generate(run_id, versions, lines)
        table = pd.DataFrame(
            {"prompt": lines, f"v{versions[0]}": texts[versions[0]], f"v{versions[1]}": texts[versions[1]]}
        )
        return gr.Dataframe(table, visible=True)


def _version_picked(version: str | None) -> tuple[gr.DownloadButton, gr.Button]:
    """Another version was picked: the zip prepared for the last one goes; a branch needs a version to start from."""
    return gr.DownloadButton(visible=False), gr.Button(interactive=bool(version))
