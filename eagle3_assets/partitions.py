"""Partitions: one ``datasets`` key per prompt file, added by a sensor or from the UI."""

import warnings

import dagster as dg

# Every check is partitioned like its asset, so results are kept per dataset (dagster#17005);
# the API is marked preview. Filtered here, where every asset and check module starts.
warnings.filterwarnings("ignore", category=dg.PreviewWarning, message=".*partitions_def on an AssetCheckSpec")

datasets_partitions = dg.DynamicPartitionsDefinition(name="datasets")
