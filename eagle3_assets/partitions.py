"""Partitions: one ``datasets`` key per prompt file, added by a sensor or from the UI."""

import dagster as dg

datasets_partitions = dg.DynamicPartitionsDefinition(name="datasets")
