"""Vector stores of HalMit's boundary points (section 3.2), with the exploration's log so that it can resume.

Two backends, one contract (:class:`Store`):

- ``sqlite:PATH`` (or a path ending in ``.db``/``.sqlite``): embedded, no server. SQLite with the ``sqlite-vec``
  extension (a ``vec0`` table with cosine distance), loaded through ``apsw``.
- ``postgresql://...``: PostgreSQL with ``pgvector`` (``vector(384)`` column, ``<=>`` cosine distance);
  ``pgserver:DIR`` starts the PostgreSQL server of the ``pgserver`` wheel on the data folder ``DIR`` (created on
  first use; a Unix socket, no TCP port) and uses it.

Every explored query is one :meth:`Store.record` call, one transaction: its event row, its boundary point (when
hallucinated) with its embedding, and the exploration's state in ``meta``. A writer killed mid-exploration loses at
most the query being written; the store stays consistent (SQLite in WAL mode with full sync, PostgreSQL's own
write-ahead log), and the exploration resumes from the events.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from halwatch.errors import HalwatchError
from halwatch.watchdog.embed import DIM


class StoreError(HalwatchError):
    """A store URI is malformed, or its database cannot be opened."""


EVENT_FIELDS = ("path", "depth", "parent", "query", "transform", "hallucinated", "entropy", "reward", "state",
                "method", "answer", "probabilities")
POINT_FIELDS = ("query", "answers", "entropy", "context", "method")


class Store:
    """Common logic; a backend gives ``_tx()`` (a transaction context), ``_exec(sql, args)`` (rows), the SQL
    placeholder ``P``, ``_put_vector(id, vector)`` and ``nearest``."""

    P = "?"

    def _init_tables(self, id_type: str, real: str) -> None:
        with self._tx():
            self._exec("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._exec(f"CREATE TABLE IF NOT EXISTS events (id {id_type} PRIMARY KEY, path INTEGER, depth INTEGER, "
                       f"parent INTEGER, query TEXT NOT NULL, transform TEXT, hallucinated INTEGER NOT NULL, "
                       f"entropy {real}, reward {real}, state INTEGER, method TEXT, answer TEXT, probabilities TEXT)")
            self._exec(f"CREATE TABLE IF NOT EXISTS points (id {id_type} PRIMARY KEY, query TEXT NOT NULL, "
                       f"answers TEXT NOT NULL, entropy {real} NOT NULL, context TEXT, method TEXT)")

    # writing
    def record(self, event: dict, point: dict | None = None, vector=None, meta: dict | None = None) -> int:
        """Write one explored query (and its boundary point and embedding) and the meta keys in one transaction;
        returns the event id."""
        p = self.P
        with self._tx():
            values = [_plain(event.get(k)) for k in EVENT_FIELDS]
            event_id = self._insert_id(
                f"INSERT INTO events ({', '.join(EVENT_FIELDS)}) VALUES ({', '.join([p] * len(values))})", values)
            if point is not None:
                values = [_plain(point.get(k)) for k in POINT_FIELDS]
                self._exec(f"INSERT INTO points (id, {', '.join(POINT_FIELDS)}) VALUES ({', '.join([p] * 6)})",
                           [event_id, *values])
                self._put_vector(event_id, _vector(vector))
            for key, value in (meta or {}).items():
                self._set_meta(key, value)
        return event_id

    def add_point(self, query: str, vector, entropy: float, answers=(), context: str = "", method: str = "") -> int:
        """A boundary point without exploration (hand-built stores, imports)."""
        return self.record({"query": query, "hallucinated": 1, "entropy": entropy, "method": method},
                           {"query": query, "answers": list(answers), "entropy": entropy, "context": context,
                            "method": method}, vector)

    def set_meta(self, **values) -> None:
        with self._tx():
            for key, value in values.items():
                self._set_meta(key, value)

    def _set_meta(self, key, value) -> None:
        p = self.P
        self._exec(f"DELETE FROM meta WHERE key = {p}", [key])
        self._exec(f"INSERT INTO meta (key, value) VALUES ({p}, {p})", [key, json.dumps(value)])

    # reading
    def meta(self) -> dict:
        return {k: json.loads(v) for k, v in self._exec("SELECT key, value FROM meta")}

    def events(self) -> list[dict]:
        rows = self._exec(f"SELECT id, {', '.join(EVENT_FIELDS)} FROM events ORDER BY id")
        out = []
        for row in rows:
            event = dict(zip(("id", *EVENT_FIELDS), row))
            event["probabilities"] = json.loads(event["probabilities"]) if event["probabilities"] else None
            out.append(event)
        return out

    def count(self) -> int:
        return int(self._exec("SELECT COUNT(*) FROM points")[0][0])

    def point(self, point_id: int) -> dict:
        rows = self._exec(f"SELECT id, {', '.join(POINT_FIELDS)} FROM points WHERE id = {self.P}", [point_id])
        if not rows:
            raise StoreError(f"no point {point_id}")
        point = dict(zip(("id", *POINT_FIELDS), rows[0]))
        point["answers"] = json.loads(point["answers"])
        return point

    def nearest(self, vector, k: int) -> list[tuple[dict, float, np.ndarray]]:
        """The ``k`` stored points most similar to ``vector``: ``(point, cosine similarity, unit vector)``, most
        similar first."""
        raise NotImplementedError


def _plain(value):
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, bool):
        return int(value)
    return value


def _vector(vector) -> np.ndarray:
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    if v.shape != (DIM,) or not np.isfinite(v).all() or not np.linalg.norm(v) > 0:
        raise StoreError(f"a point's embedding must be {DIM} finite numbers, not all zero")
    return v / np.linalg.norm(v)


class SqliteStore(Store):
    def __init__(self, path: str | Path):
        import apsw
        import sqlite_vec

        self.uri = f"sqlite:{path}"
        path = Path(path)
        if path.is_dir():
            raise StoreError(f"{path} is a folder, not a database file")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = apsw.Connection(str(path))
            self._db.enable_load_extension(True)
            self._db.load_extension(sqlite_vec.loadable_path())
            self._db.enable_load_extension(False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=10000")
            self._init_tables("INTEGER", "REAL")
            with self._tx():
                self._exec(f"CREATE VIRTUAL TABLE IF NOT EXISTS vectors USING vec0(embedding float[{DIM}] "
                           f"distance_metric=cosine)")
        except apsw.Error as exc:
            raise StoreError(f"cannot open {path} as a store: {exc}") from None

    def _tx(self):
        return self._db

    def _exec(self, sql, args=()):
        return list(self._db.execute(sql, args))

    def _insert_id(self, sql, args) -> int:
        self._db.execute(sql, args)
        return int(self._db.last_insert_rowid())

    def _put_vector(self, point_id, v) -> None:
        self._db.execute("INSERT INTO vectors (rowid, embedding) VALUES (?, ?)", [point_id, v.tobytes()])

    def nearest(self, vector, k: int):
        if k < 1 or not self.count():
            return []
        rows = self._exec("SELECT rowid, distance, embedding FROM vectors WHERE embedding MATCH ? AND k = ? "
                          "ORDER BY distance", [_vector(vector).tobytes(), int(k)])
        return [(self.point(r), 1.0 - float(d), np.frombuffer(e, dtype=np.float32)) for r, d, e in rows]

    def integrity(self) -> str:
        return str(self._exec("PRAGMA integrity_check")[0][0])

    def close(self) -> None:
        self._db.close()


class PgStore(Store):
    P = "%s"

    def __init__(self, uri: str, server=None):
        import psycopg

        self.uri, self._server = uri, server
        try:
            self._db = psycopg.connect(uri, autocommit=True, connect_timeout=10)
            self._db.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except psycopg.Error as exc:
            raise StoreError(f"cannot open the PostgreSQL store {uri}: {str(exc).strip().splitlines()[0]}") from None
        self._init_tables("BIGSERIAL", "DOUBLE PRECISION")
        with self._tx():
            self._exec(f"CREATE TABLE IF NOT EXISTS vectors (id BIGINT PRIMARY KEY REFERENCES points(id), "
                       f"embedding vector({DIM}) NOT NULL)")

    def _tx(self):
        return self._db.transaction()

    def _exec(self, sql, args=()):
        cur = self._db.execute(sql, args)
        return cur.fetchall() if cur.description else []

    def _insert_id(self, sql, args) -> int:
        return int(self._db.execute(sql + " RETURNING id", args).fetchone()[0])

    def _put_vector(self, point_id, v) -> None:
        self._db.execute("INSERT INTO vectors (id, embedding) VALUES (%s, %s::vector)", [point_id, _literal(v)])

    def nearest(self, vector, k: int):
        rows = self._exec("SELECT id, embedding <=> %s::vector AS d, embedding::text FROM vectors ORDER BY d LIMIT %s",
                          [_literal(_vector(vector)), int(k)])
        return [(self.point(r), 1.0 - float(d), np.array(json.loads(e), dtype=np.float32)) for r, d, e in rows]

    def integrity(self) -> str:
        orphans = self._exec("SELECT COUNT(*) FROM points p LEFT JOIN vectors v ON v.id = p.id WHERE v.id IS NULL")
        return "ok" if orphans[0][0] == 0 else f"{orphans[0][0]} points without a vector"

    def close(self) -> None:
        self._db.close()
        if self._server is not None:
            self._server.cleanup()


def _literal(v) -> str:
    return "[" + ",".join(f"{x:.8g}" for x in v) + "]"


def open_store(uri: str) -> Store:
    """Open (creating if needed) the store at ``uri``: ``sqlite:PATH``, ``PATH.db``, ``postgresql://...`` or
    ``pgserver:DIR``."""
    uri = str(uri).strip()
    if uri.startswith("sqlite:"):
        path = uri[len("sqlite:"):].removeprefix("//")
        if not path:
            raise StoreError("sqlite: needs a file path, e.g. sqlite:boundary.db")
        return SqliteStore(path)
    if uri.endswith((".db", ".sqlite", ".sqlite3")) and "://" not in uri:
        return SqliteStore(uri)
    if uri.startswith(("postgresql://", "postgres://")):
        return PgStore(uri)
    if uri.startswith("pgserver:"):
        import logging

        import pgserver

        folder = uri[len("pgserver:"):].removeprefix("//")
        if not folder:
            raise StoreError("pgserver: needs a data folder, e.g. pgserver:./pgdata")
        logging.getLogger("pgserver").setLevel(logging.ERROR)
        try:
            server = pgserver.get_server(Path(folder).resolve(), cleanup_mode="stop")
        except Exception as exc:  # pgserver raises plain exceptions for a bad folder or a failed start
            raise StoreError(f"cannot start PostgreSQL in {folder}: {exc}") from None
        return PgStore(server.get_uri(), server=server)
    raise StoreError(f"unknown store {uri!r}: use sqlite:PATH, PATH.db, postgresql://... or pgserver:DIR")


def stop_pgserver(folder) -> bool:
    """Stop the PostgreSQL server of a ``pgserver:DIR`` store, whoever started it (a process that was killed leaves
    it running: pgserver stops a server when its last opener exits cleanly). True when one was running."""
    import os

    from pgserver.postgres_server import pg_ctl

    data = Path(folder).resolve()
    if not (data / "postmaster.pid").exists():
        return False
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=data, user="pgserver" if os.geteuid() == 0 else None)
    return True
