"""The repository around the package: README snippet, examples, benchmark scripts, package boundaries."""
