"""Configuration presets: training presets live in configs/presets.py."""
