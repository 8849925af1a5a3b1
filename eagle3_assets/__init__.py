"""eagle3-assets: a Dagster asset graph from prompt datasets to EAGLE-3 drafters."""

from eagle3_assets.checkout_packages import install as _map_checkout_folders

__version__ = "0.1.0"

_map_checkout_folders()  # eagle3_assets.resources / .sensors in a checkout run without installing it
