"""The model: loading, the tiny embedded builder, the runner, attention, cascade, gathers."""
