"""The data root and the metadata DuckDB file."""


from contextlib import contextmanager

import dagster as dg
import duckdb

from eagle3_assets.paths import DataLayout


class StorageResource(dg.ConfigurableResource):
    """Where every asset reads and writes. Empty ``root`` means ``$EAGLE3_HOME`` or ``data/``."""

    root: str = ""

    @property
    def layout(self) -> DataLayout:
        return DataLayout.from_env(self.root or None)

    @contextmanager
    def query(self):
        """An in-memory DuckDB for queries over Parquet files, with the metadata DB attached
        read-only when it exists: checks never take the writer's lock."""
        con = duckdb.connect()
        try:
            db = self.layout.metadata_db
            if db.exists():
                con.execute(f"ATTACH '{db}' AS meta (READ_ONLY)")
            yield con
        finally:
            con.close()
