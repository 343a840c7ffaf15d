"""The laptop quick start: train a tiny model at a short context, retrieve at up to 500x."""
