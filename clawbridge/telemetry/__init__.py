"""Figures for people and dashboards: Prometheus metrics and step metrics sent to experiment trackers."""
