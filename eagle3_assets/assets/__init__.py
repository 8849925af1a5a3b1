"""The asset graph, one module per stage."""
