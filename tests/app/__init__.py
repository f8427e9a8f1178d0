"""Tests of app/ that call its pages and form in process; browser/ drives the panel in Chromium."""
