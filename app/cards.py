"""Small HTML pieces the pages share: status badges, the progress bar, job cards, alert banners, field errors.

Everything that comes from a run (log lines, prompts, messages) is escaped here: a completion is text to read, never
markup to render.
"""

from __future__ import annotations

import functools
import json
import time
from html import escape
from typing import TYPE_CHECKING, Any

from app.formatting import ago, clock, duration, money, number
from backend.database.models import Event, Job, RolloutSample, Run
from backend.database.turns import Turn
from backend.services.adapters import Comparison
from backend.services.evaluation import Evaluation
from backend.services.queries import HeldOutScore, SampleUse
from backend.services.smoke import SmokeReport
from jobs.contract import RunSpec
from jobs.evaluation.results import VersionEval
from jobs.evaluation.statistics import Paired

if TYPE_CHECKING:
    from jobs.proxy.stats import ProxySnapshot

STATUS_TONE = {
    "draft": "muted",
    "launching": "info",
    "running": "good",
    "degraded": "warn",
    "stalled": "warn",
    "finalizing": "info",
    "stopping": "warn",
    "finished": "done",
    "failed": "bad",
    "stopped": "muted",
    "scheduling": "info",
    "completed": "done",
    "error": "bad",
    "canceled": "muted",
}


def badge(status: str) -> str:
    return f'<span class="gp-badge gp-{STATUS_TONE.get(status, "muted")}">{escape(status)}</span>'


def empty_state(message: str) -> str:
    return f'<div class="gp-empty">{escape(message)}</div>'


def field_error(messages: list[str]) -> str:
    """The red note shown right under a form field; empty when the field is fine."""
    if not messages:
        return ""
    items = "".join(f"<li>{escape(m)}</li>" for m in messages)
    return f'<ul class="gp-field-error" role="alert">{items}</ul>'


def note(message: str, tone: str = "info") -> str:
    return f'<div class="gp-note gp-note-{tone}">{escape(message)}</div>'


def cost_line(price: str, detail: str) -> str:
    """The Launch page's cost line: a price, then where it comes from (which may quote the Hub or a typed flavor)."""
    return f'<div class="gp-cost">{escape(price)} <span class="gp-meta">{escape(detail)}</span></div>'


def selected_run(run: Run, versions: int) -> str:
    """The Runs page's note on the run a click selected."""
    return (
        f'<div class="gp-note gp-note-info">Selected <b>{escape(run.name or run.id)}</b> <code>{escape(run.id)}</code> '
        f"{badge(run.status)} · {versions} adapter version{'s' if versions != 1 else ''}</div>"
    )


def lineage(run: Run, children: list[Run]) -> str:
    """The Adapters page's line on where a run comes from and which branches trained from it."""
    parts = []
    if run.parent_run_id:
        parts.append(f"branched from <b>{escape(run.parent_run_id)}</b> at v{run.parent_version}")
    if children:
        listed = ", ".join(f"<b>{escape(c.id)}</b> (from v{c.parent_version}, {escape(c.status)})" for c in children)
        parts.append(f"branches trained from it: {listed}")
    if not parts:
        parts.append("an original run (no parent, no branches yet)")
    return f'<div class="gp-meta">Lineage: {" · ".join(parts)}</div>'


def comparison_stats(comparison: Comparison) -> str:
    """The Adapters page's figures for two versions: each one's ‖ΔW‖, their difference and cosine, the steps."""
    cosine = number(comparison.total_cosine) if comparison.total_cosine is not None else "—"
    figures = [
        (f"‖ΔW‖ v{comparison.version_a}", number(comparison.total_norm_a)),
        (f"‖ΔW‖ v{comparison.version_b}", number(comparison.total_norm_b)),
        ("‖difference‖", number(comparison.total_diff_norm)),
        ("cosine similarity", cosine),
        ("modules", str(len(comparison.modules))),
        ("steps", f"{comparison.step_a} → {comparison.step_b}"),
    ]
    cells = "".join(f"<div><span>{escape(label)}</span><b>{escape(value)}</b></div>" for label, value in figures)
    return f'<div class="gp-stats">{cells}</div>'


def held_out_comparison(evaluation: Evaluation, paired: Paired) -> str:
    """Two versions on the held-out prompts: each one's mean reward with its 95 % interval, their difference prompt
    by prompt, and how many prompts each won."""
    a, b = evaluation.results
    avg_a, avg_b = (result.summary("reward").avg for result in (a, b))
    d = paired.difference
    figures = [
        (f"v{a.version} held-out reward", f"{avg_a.mean:.3f} ± {avg_a.half_width:.3f}"),
        (f"v{b.version} held-out reward", f"{avg_b.mean:.3f} ± {avg_b.half_width:.3f}"),
        (f"v{b.version} − v{a.version}", f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"),
        (f"prompts v{b.version} higher / equal / lower", f"{paired.wins} / {paired.ties} / {paired.losses}"),
    ]
    cells = "".join(f"<div><span>{escape(label)}</span><b>{escape(value)}</b></div>" for label, value in figures)
    return f'<div class="gp-stats">{cells}</div>' + note(_held_out_how(evaluation))


def held_out_evaluation(evaluation: Evaluation, best: VersionEval) -> str:
    """Versions scored on the held-out prompts: which scored best, and how they were scored."""
    avg = best.summary("reward").avg
    figures = [
        ("versions evaluated", str(len(evaluation.results))),
        ("best by held-out reward", f"v{best.version}: {avg.mean:.3f} ± {avg.half_width:.3f}"),
        ("read back from the bucket", str(sum(evaluation.cached))),
    ]
    cells = "".join(f"<div><span>{escape(label)}</span><b>{escape(value)}</b></div>" for label, value in figures)
    return f'<div class="gp-stats">{cells}</div>' + note(_held_out_how(evaluation))


def _held_out_how(evaluation: Evaluation) -> str:
    held, sampling = evaluation.held_out, evaluation.sampling
    dropped = f"; {held.shared} shared with training left out" if held.shared else ""
    cached = " (read back from the bucket)" if all(evaluation.cached) else ""
    how = f"{len(held.rows)} held-out prompts ({held.source}{dropped}), {sampling.k} samples each{cached}; ± is the "
    job = f" Evaluated on HF Jobs: {evaluation.job.summary()}." if evaluation.job is not None else ""
    return how + "95 % interval over prompts." + job


def json_block(data: Any) -> str:
    """`data` as indented JSON in a scrollable block, every line in the page (a code editor would render only the
    lines in view)."""
    return f'<pre class="gp-json">{escape(json.dumps(data, indent=2, ensure_ascii=False))}</pre>'


def smoke_report(report: SmokeReport) -> str:
    """The smoke test's steps, each with its time and what it found, under a line that says how it ended."""
    rows = "".join(
        f"<tr><td>{'✓' if step.ok else '✗'}</td><td>{escape(step.name)}</td><td>{duration(step.seconds)}</td>"
        f"<td>{escape(step.detail)}</td></tr>"
        for step in report.steps
    )
    link = f' <a href="{escape(report.job_url)}" target="_blank">the job</a>' if report.job_url else ""
    table = f'<table id="smoke-steps"><tbody>{rows}</tbody></table>'
    return note(report.summary(), "good" if report.ok else "bad") + f'<div class="gp-table-wrap">{table}{link}</div>'


def eta_seconds(run: Run, step_seconds: float | None) -> float | None:
    """Time left: the steps left at the run's recent seconds per step; None (estimating) until steps are timed.
    Never the average since the start: that counts the start-up as if every step paid it again."""
    left = max(run.max_steps - run.step, 0)
    if left == 0:
        return 0.0
    return left * step_seconds if step_seconds else None


def _time_left(seconds: float | None) -> str:
    return "estimating…" if seconds is None else duration(seconds)


def run_list(runs: list[Run]) -> str:
    """Each run's key facts on one line (id, status, step, latest reward): what fits a phone's width."""
    if not runs:
        return ""
    items = "".join(
        f"<li><code>{escape(run.id)}</code> {badge(run.status)} step {run.step} / {run.max_steps}"
        f" · reward {f'{run.latest_reward:.3f}' if run.latest_reward is not None else '—'}</li>"
        for run in runs
    )
    return f'<ul class="gp-run-list">{items}</ul>'


def run_header(
    run: Run,
    step_seconds: float | None,
    now: float | None = None,
    current_step: int | None = None,
    sample_use: SampleUse | None = None,
    best_by_eval: HeldOutScore | None = None,
) -> str:
    """Status, progress from step to max steps, time elapsed and left, the share of generated samples trained on,
    cost so far, the current adapter version with the step it holds (`current_step`): v1 is the weights before
    the first step, so vN+1 follows step N; and, once versions are evaluated, the best on held-out prompts."""
    now = now or time.time()
    fraction = min(run.step / run.max_steps, 1.0) if run.max_steps else 0.0
    end = run.finished_at or now
    elapsed = end - run.started_at if run.started_at else None
    active = run.status in ("launching", "running", "degraded", "stalled")
    left = eta_seconds(run, step_seconds) if active else None
    reward = f"{run.latest_reward:.3f}" if run.latest_reward is not None else "—"
    tone = STATUS_TONE.get(run.status, "muted")
    # A failure is said in the banner below the header, in its tone: not twice.
    shown = run.status_message and run.status != "failed"
    message = f'<div class="gp-status-message">{escape(run.status_message)}</div>' if shown else ""
    parent = (
        f'<span class="gp-meta">branch of <b>{escape(run.parent_run_id)}</b> v{run.parent_version}</span>'
        if run.parent_run_id
        else ""
    )
    return f"""
<div class="gp-run-header">
  <div class="gp-run-title"><span class="gp-run-name">{escape(run.name or run.id)}</span>
    <code>{escape(run.id)}</code> {badge(run.status)} {parent}</div>
  <div class="gp-progress" role="progressbar" aria-valuenow="{run.step}" aria-valuemax="{run.max_steps}">
    <div class="gp-progress-fill gp-{tone}-fill" style="width:{fraction * 100:.1f}%"></div>
  </div>
  <div class="gp-stats">
    <div><span>step</span><b>{run.step} / {run.max_steps}</b></div>
    <div><span>latest reward</span><b>{reward}</b></div>
    <div><span>elapsed</span><b>{duration(elapsed)}</b></div>
    <div><span>time left</span><b>{_time_left(left) if active else "—"}</b></div>
    {_trained_on(sample_use)}
    <div><span>cost so far</span><b>{money(run.cost_usd)}</b></div>
    <div><span>adapter</span><b>{_version_text(run, current_step)}</b></div>
    {_best_by_eval(best_by_eval)}
  </div>
  {reported_to(run.spec_json)}
  {message}
</div>"""


@functools.lru_cache(maxsize=256)
def reported_to(spec_json: str) -> str:
    """Where the trainer also reports the run (its spec's Reporting section), with a link where there is one; empty
    when only the panel has it. Cached by spec: it is asked on every tick."""
    spec = RunSpec.from_json(spec_json)
    reporting, places = spec.reporting, []
    if reporting.trackio and reporting.trackio_space:
        url = f"https://huggingface.co/spaces/{reporting.trackio_space}"
        places.append(f'Trackio: <a href="{escape(url)}" target="_blank">{escape(reporting.trackio_space)}</a>')
    elif reporting.trackio:
        command = f"trackio show --project {reporting.project}"
        places.append(f"Trackio: project {escape(reporting.project)} on this machine (<code>{escape(command)}</code>)")
    if reporting.wandb:
        path = "/".join(filter(None, [reporting.wandb_entity, reporting.project]))
        url = f"https://wandb.ai/{reporting.wandb_entity}/{reporting.project}" if reporting.wandb_entity else ""
        shown = f'<a href="{escape(url)}" target="_blank">{escape(path)}</a>' if url else f"project {escape(path)}"
        places.append(f"W&amp;B: {shown}")
    if not places:
        return ""
    where = " · ".join(places)
    return f'<div class="gp-meta gp-reported-to">also reported to {where}, as run {escape(spec.run_id)}</div>'


def sample_count(offset: int, shown: int, total: int, page: int, pages: int) -> str:
    """Which of the samples that pass the filters the table holds: never a silent cap."""
    if not total:
        return '<div class="gp-meta">No sample passes these filters.</div>'
    where = f" · page {page} of {pages} (type another page and press Enter)" if pages > 1 else ""
    return f'<div class="gp-meta">Samples {offset + 1:,}–{offset + shown:,} of {total:,}{where}</div>'


def _trained_on(use: SampleUse | None) -> str:
    """The share of the samples the trainer took from the replicas that it trained on: the rest were generated (and
    paid for) in vain, too stale by the time the trainer reached them."""
    if use is None or not use.pulled:
        return "<div><span>trained on</span><b>—</b></div>"
    why = f"{use.trained:,} of the {use.pulled:,} samples the trainer took; the rest were too stale"
    return f'<div title="{why}"><span>trained on</span><b>{use.trained_share:.0%} of samples</b></div>'


def _best_by_eval(best: HeldOutScore | None) -> str:
    """The version with the highest held-out reward, scored on prompts the run never trained on; the base model
    included (training may have made things worse), where the `best` alias names an adapter version."""
    if best is None:
        return ""
    why = f"the highest mean reward on the held-out prompts, at step {best.step}"
    return f'<div title="{why}"><span>best by eval</span><b>v{best.version} ({best.mean:.3f})</b></div>'


def _version_text(run: Run, current_step: int | None) -> str:
    parts = []
    if run.current_version is not None:
        held = f" (step {current_step})" if current_step is not None else ""
        parts.append(f"current v{run.current_version}{held}")
    if run.best_version is not None:
        parts.append(f"best v{run.best_version}")
    return " · ".join(parts) or "none yet"


def alert_banner(alerts: list[Event]) -> str:
    if not alerts:
        return ""
    rows = "".join(
        f'<div class="gp-alert gp-alert-{escape(a.level)}"><b>{escape(a.kind.replace("_", " "))}</b> '
        f"{escape(a.message)} <span class='gp-meta'>{ago(a.time)}</span></div>"
        for a in alerts[:5]
    )
    return f'<div class="gp-alerts" role="alert">{rows}</div>'


def alert_history(alerts: list[Event]) -> str:
    """Every alert of a run, newest first: raised when (and at which step), what it said, and how it ended."""
    if not alerts:
        return empty_state("No alert so far: alerts raised on this run stay listed here once they clear.")
    rows = []
    for a in alerts:
        if a.active:
            state = '<span class="gp-badge gp-warn">in force</span>'
        elif a.dismissed:
            state = '<span class="gp-badge gp-muted">dismissed</span>'
        else:
            state = f'<span class="gp-badge gp-good">cleared</span> {clock(a.cleared_at)}' if a.cleared_at else "—"
        step = f"step {a.step}" if a.step is not None else "—"
        rows.append(
            f"<tr><td>{clock(a.time)}</td><td>{step}</td><td>{escape(a.level)}</td>"
            f"<td><b>{escape(a.kind.replace('_', ' '))}</b> {escape(a.message)}</td><td>{state}</td></tr>"
        )
    head = "<tr><th>raised</th><th>at</th><th>level</th><th>alert</th><th>now</th></tr>"
    return f'<div class="gp-table-wrap"><table>{head}{"".join(rows)}</table></div>'


def job_cards(jobs: list[Job], heartbeats: dict[str, dict[str, Any]], local: bool, now: float | None = None) -> str:
    """One card per job: role, stage, hardware and price, a link to its page, its heartbeat, its last log lines."""
    if not jobs:
        return empty_state("Jobs appear here once the launch starts them: the replicas first, then the trainer.")
    now = now or time.time()
    cards = []
    for job in jobs:
        beat = heartbeats.get(job.role) or {}
        link = f'<a href="{escape(job.url)}" target="_blank" rel="noopener">job page ↗</a>' if job.url else ""
        ended = job.stage in ("completed", "error", "canceled")
        if job.started_at is None or (ended and job.finished_at is None):
            ran = "—"
        else:
            ran = duration((job.finished_at or now) - job.started_at)
        state = beat.get("state") or beat.get("phase")
        beat_text = f"{escape(str(state))}, heartbeat {ago(beat.get('time'), now)}" if beat else "no heartbeat yet"
        price = f" · {money(job.price_per_hour, per_hour=True)}" if job.price_per_hour else ""
        hardware = "local process" if local else job.flavor
        tail = "\n".join(job.log_tail.strip().splitlines()[-8:]) or "(no output yet)"
        cards.append(f"""
<div class="gp-card">
  <div class="gp-card-head"><b>{escape(job.role)}</b> {badge(job.stage)} <span class="gp-meta">{link}</span></div>
  <div class="gp-meta">{escape(hardware)}{price} · ran {ran} · {beat_text}</div>
  {f'<div class="gp-meta">{escape(job.message)}</div>' if job.message else ""}
  <div class="gp-log"><pre>{escape(tail)}</pre></div>
</div>""")
    return f'<div class="gp-cards">{"".join(cards)}</div>'


def versions_held(snapshot: ProxySnapshot | None, heartbeats: dict[str, dict[str, Any]], newest: int | None) -> str:
    """A grid of replicas × adapter versions: which versions each replica holds right now.

    The proxy's view (what it loaded on each replica) comes first; a replica's own heartbeat (what its engine lists)
    fills in when the proxy has not reported yet. Both should agree; the trainer's newest version is highlighted.
    """
    held: dict[str, set[int]] = {}
    for replica in (snapshot.get("replicas") if snapshot else None) or []:
        if replica.get("loaded_versions") is not None:
            held[str(replica.get("role"))] = set(replica["loaded_versions"])
    for role, beat in heartbeats.items():
        if role.startswith("replica") and role not in held:
            held[role] = {a["version"] for a in beat.get("adapters") or [] if a.get("version") is not None}
    if not held:
        return empty_state("Appears once the replicas report the adapter versions they hold.")
    versions = sorted(set().union(*held.values()) | ({newest} if newest else set()))[-12:]
    head = "".join(f'<th class="{"gp-newest" if v == newest else ""}">v{v}</th>' for v in versions)
    body = ""
    for role in sorted(held):
        cells = "".join(
            f'<td class="{"gp-held" if v in held[role] else "gp-missing"}">{"●" if v in held[role] else "·"}</td>'
            for v in versions
        )
        body += f"<tr><th>{escape(role)}</th>{cells}</tr>"
    caption = f"newest published: v{newest}" if newest else "no version published yet"
    return f"""<div class="gp-card"><div class="gp-card-head"><b>Adapter versions loaded on each replica</b>
<span class="gp-meta">{caption} · ● loaded (what the proxy loaded on each replica, else its heartbeat)</span></div>
<table class="gp-grid"><thead><tr><th>replica</th>{head}</tr></thead><tbody>{body}</tbody></table></div>"""


def sample_card(title: str, sample: RolloutSample | None) -> str:
    """One rollout sample: prompt, completion (an agent's episode turn by turn), total and per-reward scores,
    advantage, the version that wrote it."""
    if sample is None:
        return empty_state("No sample")
    scores = sample.rewards
    score_rows = "".join(
        f"<tr><td>{escape(name)}</td><td>{value:.3f}</td></tr>"
        if isinstance(value, int | float)
        else f"<tr><td>{escape(name)}</td><td>—</td></tr>"
        for name, value in scores.items()
    )
    reward = f"{sample.reward:.3f}" if sample.reward is not None else "—"
    dropped = ' <span class="gp-badge gp-bad">dropped: too stale</span>' if sample.dropped else ""
    turns = sample.turns
    if turns is None:
        written, completion = f"generated by v{sample.policy_version}", escape(sample.completion)
        body = f'<div class="gp-label">completion</div><pre class="gp-text gp-completion">{completion}</pre>'
    else:
        written, body = f"started on v{sample.policy_version}", _episode(turns, sample.policy_version, reward)
    return f"""
<div class="gp-card gp-sample">
  <div class="gp-card-head"><b>{escape(title)}</b> reward <b>{reward}</b>{dropped}</div>
  <div class="gp-meta">advantage {sample.advantage:+.3f} · {written}
    ({sample.staleness} behind the trainer) · step {sample.step} · group {sample.group_id}</div>
  <div class="gp-label">prompt</div><pre class="gp-text">{escape(sample.prompt)}</pre>
  {body}
  <table class="gp-scores"><thead><tr><th>reward function</th><th>score</th></tr></thead>
    <tbody>{score_rows}</tbody></table>
</div>"""


def _episode(turns: list[Turn], started_on: int, reward: str) -> str:
    """An agent's episode turn by turn: who spoke (the model, with the version that generated the turn, or a tool),
    what it said, each tool call with its arguments; then the reward the whole episode earned."""
    calls = sum(len(turn.tool_calls) for turn in turns)
    items = "".join(_turn(number, turn, started_on) for number, turn in enumerate(turns, 1))
    return (
        f'<div class="gp-label">episode: {_count(len(turns), "turn")}, {_count(calls, "tool call")}</div>'
        f'<ol class="gp-turns">{items}</ol><div class="gp-meta">episode reward <b>{reward}</b></div>'
    )


def _turn(number: int, turn: Turn, started_on: int) -> str:
    if turn.by_model:
        kind, who = "model", f"model · {_generated_by(turn.version, started_on)}"
    elif turn.role == "tool":
        kind, who = "tool", f"tool <b>{escape(turn.name or '?')}</b> answered"
    else:
        kind, who = "other", escape(turn.role)
    text = f'<pre class="gp-text">{escape(turn.content)}</pre>' if turn.content else ""
    calls = "".join(
        f'<div class="gp-tool-call">→ calls <b>{escape(call.name)}</b>'
        f'<pre class="gp-text">{escape(_arguments(call.arguments))}</pre></div>'
        for call in turn.tool_calls
    )
    head = f'<div class="gp-turn-head">turn {number} · {who}</div>'
    return f'<li class="gp-turn gp-turn-{kind}">{head}{text}{calls}</li>'


def _generated_by(version: int | None, started_on: int) -> str:
    """The version that generated a model turn, marked where it is not the one the episode started on: a weight
    sync landed during the episode."""
    if version is None:
        return "version unknown"
    if version == started_on:
        return f"v{version}"
    why = "after a sync" if version > started_on else f"the episode started on v{started_on}"
    return f'<span class="gp-synced">v{version} ({why})</span>'


def _arguments(arguments: dict[str, Any] | str) -> str:
    """A tool call's arguments one per line, a text as it is (code keeps its lines); unparsed ones as written."""
    if isinstance(arguments, str):
        return arguments
    if not arguments:
        return "(no arguments)"
    shown = (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False) for value in arguments.values())
    return "\n".join(f"{name} = {value}" for name, value in zip(arguments, shown, strict=True))


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
