"""Operating a node: metrics, the dashboard, charts and process memory tuning."""
