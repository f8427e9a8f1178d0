"""The panel's theme and the CSS behind the HTML pieces in `app.cards` (badges, cards, progress bar, grids)."""

from __future__ import annotations

import gradio as gr


def theme() -> gr.themes.Base:
    return gr.themes.Soft(primary_hue="indigo", secondary_hue="slate", neutral_hue="slate", radius_size="md").set(
        block_title_text_weight="600"
    )


CSS = """
.gradio-container { max-width: 1320px !important; width: 100% !important; margin: auto; }
.gp-title h1 { margin-bottom: 0; font-size: 1.5rem; }
.gp-title p { margin-top: 2px; color: var(--body-text-color-subdued); }
.gp-section-title h3 { margin: 6px 0 0 0; font-size: 1.05rem; }
.gp-badge { display: inline-block; padding: 1px 9px; border-radius: 999px; font-size: 0.78rem; font-weight: 600;
  vertical-align: middle; letter-spacing: 0.01em; }
.gp-good { background: #dcfce7; color: #166534; } .gp-info { background: #dbeafe; color: #1e40af; }
.gp-warn { background: #fef3c7; color: #92400e; } .gp-bad { background: #fee2e2; color: #991b1b; }
.gp-done { background: #e0e7ff; color: #3730a3; } .gp-muted { background: #f1f5f9; color: #475569; }
.gp-empty { padding: 18px; border: 1px dashed var(--border-color-primary); border-radius: 8px;
  color: var(--body-text-color-subdued); text-align: center; font-size: 0.95rem; }
.gp-field-error { margin: 2px 0 6px 0; padding: 6px 10px 6px 26px; border-left: 3px solid #dc2626;
  background: #fef2f2; color: #991b1b; border-radius: 4px; font-size: 0.9rem; }
.gp-field-error li { margin: 1px 0; }
.gp-note { padding: 8px 12px; border-radius: 6px; font-size: 0.92rem; }
.gp-note-info { background: #eff6ff; color: #1e3a8a; } .gp-note-good { background: #f0fdf4; color: #166534; }
.gp-note-warn { background: #fffbeb; color: #92400e; } .gp-note-bad { background: #fef2f2; color: #991b1b; }
/* Dark mode: the same tones, dark grounds and light text (light banners glared on a dark page). */
.dark .gp-note-info, .dark .gp-alert-info { background: #172554; color: #dbeafe; }
.dark .gp-note-good { background: #052e16; color: #dcfce7; }
.dark .gp-note-warn, .dark .gp-alert-warning { background: #451a03; color: #fef3c7; }
.dark .gp-note-bad, .dark .gp-alert-error, .dark .gp-field-error { background: #450a0a; color: #fee2e2; }
.gp-json { max-height: 420px; overflow: auto; font-size: 0.8rem; padding: 8px 12px; margin: 0; white-space: pre; }
.gp-run-header { padding: 4px 2px; }
.gp-run-title { display: flex; gap: 10px; align-items: center; flex-wrap: wrap; }
.gp-run-name { font-size: 1.2rem; font-weight: 700; }
.gp-progress { height: 10px; background: #e2e8f0; border-radius: 999px; overflow: hidden; margin: 10px 0 8px 0; }
.gp-progress-fill { height: 100%; border-radius: 999px; transition: width 0.6s ease; }
.gp-good-fill, .gp-info-fill { background: linear-gradient(90deg, #6366f1, #22c55e); }
.gp-warn-fill { background: #f59e0b; } .gp-bad-fill { background: #ef4444; }
.gp-done-fill { background: #6366f1; } .gp-muted-fill { background: #94a3b8; }
.gp-stats { display: grid; grid-template-columns: repeat(auto-fit, minmax(110px, 1fr)); gap: 8px; }
.gp-stats div { background: var(--block-background-fill); border: 1px solid var(--border-color-primary);
  border-radius: 8px; padding: 6px 10px; }
.gp-stats span { display: block; font-size: 0.75rem; color: var(--body-text-color-subdued); text-transform: uppercase;
  letter-spacing: 0.04em; }
.gp-stats b { font-size: 1.05rem; }
.gp-status-message { margin-top: 6px; color: var(--body-text-color-subdued); font-size: 0.9rem;
  white-space: pre-wrap; }
.gp-meta { color: var(--body-text-color-subdued); font-size: 0.85rem; }
.gp-alerts { display: flex; flex-direction: column; gap: 6px; }
.gp-alert { padding: 8px 12px; border-radius: 6px; border-left: 4px solid; font-size: 0.92rem; }
.gp-alert-error { background: #fef2f2; border-color: #dc2626; color: #7f1d1d; }
.gp-alert-warning { background: #fffbeb; border-color: #f59e0b; color: #78350f; }
.gp-alert-info { background: #eff6ff; border-color: #3b82f6; color: #1e3a8a; }
.gp-cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(330px, 1fr)); gap: 10px; }
.gp-card { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 10px 12px;
  background: var(--block-background-fill); }
.gp-card-head { display: flex; gap: 8px; align-items: center; margin-bottom: 4px; flex-wrap: wrap; }
.gp-log { max-height: 190px; overflow: auto; display: flex; flex-direction: column-reverse; background: #0f172a;
  border-radius: 6px; margin: 6px 0 0 0; }
.gp-log pre { font-size: 0.75rem; color: #e2e8f0; background: transparent; padding: 6px 8px; margin: 0;
  white-space: pre-wrap; overflow-wrap: anywhere; }
.gp-label { font-size: 0.75rem; text-transform: uppercase; color: var(--body-text-color-subdued);
  margin-top: 8px; letter-spacing: 0.04em; }
.gp-text { white-space: pre-wrap; word-break: break-word; font-size: 0.85rem; margin: 2px 0; padding: 6px 8px;
  background: var(--background-fill-secondary); border-radius: 6px; max-height: 240px; overflow: auto; }
.gp-completion { border-left: 3px solid #6366f1; }
/* An agent's episode: one entry per turn, the model's marked like a completion, a tool's answers in green; a model
   turn generated by a later version than the episode started on (a sync landed) stands out. */
.gp-turns { list-style: none; margin: 2px 0; padding: 0; display: flex; flex-direction: column; gap: 6px; }
.gp-turn { border-left: 3px solid #6366f1; padding-left: 8px; }
.gp-turn-tool { border-left-color: #22c55e; } .gp-turn-other { border-left-color: #94a3b8; }
.gp-turn-head, .gp-tool-call { font-size: 0.8rem; color: var(--body-text-color-subdued); }
.gp-synced { color: #b45309; font-weight: 600; }
.gp-scores { margin-top: 8px; font-size: 0.85rem; border-collapse: collapse; }
.gp-scores td, .gp-scores th, .gp-grid td, .gp-grid th { border: none !important;
  border-bottom: 1px solid var(--border-color-primary) !important; }
.gp-scores td, .gp-scores th { padding: 2px 16px 2px 0; text-align: left; }
.gp-grid, .gp-scores, .gp-grid tr, .gp-scores tr { border: none !important; }
.gp-grid { border-collapse: collapse; font-size: 0.9rem; margin: 6px 0 2px 0; }
.gp-grid th, .gp-grid td { padding: 4px 14px; min-width: 44px; border: none; text-align: center;
  border-bottom: 1px solid var(--border-color-primary); }
.gp-grid th:first-child { text-align: left; }
.gp-held { color: #16a34a; font-size: 1.1rem; } .gp-missing { color: #cbd5e1; }
.gp-newest { color: #4f46e5; text-decoration: underline; }
button:disabled, button[disabled] { opacity: 0.45; cursor: not-allowed; filter: grayscale(0.6); }
.gp-align-end { align-items: flex-end !important; }
.gp-cost { font-size: 1.1rem; font-weight: 600; padding: 8px 0; }
.gp-launch-bar { border-top: 1px solid var(--border-color-primary); padding-top: 10px; margin-top: 8px; }
.gp-table-wrap table { width: 100%; border-collapse: collapse; font-size: 0.9rem; }
.gp-table-wrap th { text-align: left; font-weight: 600; color: var(--body-text-color-subdued);
  border-bottom: 2px solid var(--border-color-primary); padding: 6px 8px; }
.gp-table-wrap td { border-bottom: 1px solid var(--border-color-primary); padding: 6px 8px; vertical-align: top; }
/* Figures follow the page's theme: plotly draws on white, so in dark mode its drawing is inverted, and turned back
   round the color wheel so that every series keeps its hue (blue stays blue). */
.gp-phone-only { display: none !important; }
.gp-run-list { margin: 0; padding-left: 18px; font-size: 0.9rem; } .gp-run-list li { margin: 3px 0; }
.dark .js-plotly-plot .main-svg { filter: invert(0.9) hue-rotate(180deg); }
/* At phone width every tab stays in the bar: Gradio moves those that do not fit (measured on a hidden copy with the
   same classes, so this applies to both) behind a "⋯" menu that hides whole pages. */
@media (max-width: 520px) {
  .tab-wrapper button { padding: 4px 6px !important; font-size: 0.82rem !important; }
  .tab-wrapper { gap: 0 !important; }
  /* A row of controls becomes a column, each control whole: the Monitor's run picker was cut, and the Adapters
     page's lineage note, squeezed beside its picker, wrapped a word a line. */
  .gp-align-end > * { min-width: 100% !important; }
  /* The form's rows of fields (Gradio groups them in one .form box): at most two side by side, so that no label
     is cut ("Trackic", "Weigh & Biase"). */
  .gp-fields .form { flex-wrap: wrap !important; }
  .gp-fields > *, .gp-fields .form > * { min-width: calc(50% - var(--layout-gap, 8px)) !important; }
  .gp-phone-only { display: block !important; }
}
"""

# A slider's number box commits only when it loses focus (Gradio then sends `release`); in a box marked
# `gp-enter-commits`, Enter commits too, as in any other field of the panel.
HEAD = """
<script>
document.addEventListener("keydown", (event) => {
  const box = event.target;
  if (event.key === "Enter" && box instanceof HTMLInputElement && box.type === "number"
      && box.closest(".gp-enter-commits")) {
    box.blur();
  }
});
</script>
"""
