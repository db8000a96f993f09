"""Report: this run's numbers as Markdown tables (`render`) and figures (`plots`)."""
