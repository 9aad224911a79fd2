"""Names the Serve application's parts know each other by (no imports: every part reads them)."""

GATEWAY_DEPLOYMENT = "gateway"
REGISTRY_DEPLOYMENT = "registry"
