"""Command-line tools of the kit: data preparation, bundling, records, significance, plots, benchmarks."""
