"""The reproducibility workbench: experiments, their results store, the papermill runner, benchmarks, figures and
the report."""
