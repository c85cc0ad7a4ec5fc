"""Deploy-file generators: the Serve config and the Helm values schema."""
