"""Where models come from and live: the catalog, the hub, downloads and the local store."""
