"""The tuning table, the tuner and the model shape presets."""
