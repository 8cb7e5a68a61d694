"""Reports from a store: post-mortems, power recommendations and plots, heatmaps, SQL queries and the
query API."""
