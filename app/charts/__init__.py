"""Plotly figures for the panel's pages; each module draws the figures of one subject."""
