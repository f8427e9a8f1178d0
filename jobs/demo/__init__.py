"""The embedded demo: tiny models, datasets and presets built on this machine, with nothing downloaded."""
