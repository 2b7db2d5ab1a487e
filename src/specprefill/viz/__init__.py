"""Token-importance views: `heatmap` (pure HTML) and `explorer` (the ipywidgets explorer)."""
