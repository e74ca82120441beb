"""Vector stores of HalMit's boundary points (section 3.2), with the exploration's log so that it can resume.

Two backends, one contract (:class:`Store`):

- ``sqlite:PATH`` (or a path ending in ``.db``/``.sqlite``): embedded, no server. SQLite with the ``sqlite-vec``
  extension (a ``vec0`` table with cosine distance), loaded through ``apsw``.
- ``postgresql://...``: PostgreSQL with ``pgvector`` (``vector(384)`` column, ``<=>`` cosine distance);
  ``pgserver:DIR`` starts the PostgreSQL server of the ``pgserver`` wheel on the data folder ``DIR`` (created on
  first use; a Unix socket, no TCP port) and uses it.

Every explored query is one :meth:`Store.record` call, one transaction: its event row, its boundary point (when
hallucinated) with its embedding, and the exploration's state in ``meta`` (written as upserts, so that two explorers
on one store do not collide). A writer killed mid-exploration loses at most the query being written; the store stays
consistent (SQLite in WAL mode with full sync, PostgreSQL's own write-ahead log), and the exploration resumes from the
events. A call that failed for good is kept in ``failures`` with its query and error.

The store records its embedder (:meth:`Store.bind_embedder`: name, hash, dimensions) and refuses another one. On
PostgreSQL the embeddings have an HNSW index (pgvector, cosine). A password in a ``postgresql://`` URI never appears
in a message or in the store's ``uri`` (:func:`redact`).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

import numpy as np

from halwatch.errors import HalwatchError
from halwatch.watchdog.embed import DEFAULT, DIM


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
            self._exec(f"CREATE TABLE IF NOT EXISTS failures (id {id_type} PRIMARY KEY, query TEXT NOT NULL, "
                       f"error TEXT NOT NULL)")
            self._exec(f"CREATE TABLE IF NOT EXISTS events (id {id_type} PRIMARY KEY, path INTEGER, depth INTEGER, "
                       f"parent INTEGER, query TEXT NOT NULL, transform TEXT, hallucinated INTEGER NOT NULL, "
                       f"entropy {real}, reward {real}, state INTEGER, method TEXT, answer TEXT, probabilities TEXT)")
            self._exec(f"CREATE TABLE IF NOT EXISTS points (id {id_type} PRIMARY KEY, query TEXT NOT NULL, "
                       f"answers TEXT NOT NULL, entropy {real} NOT NULL, context TEXT, method TEXT)")

    def _init_vectors(self) -> None:
        """The vectors table as it is, or made with the dimension of the store's embedder (384 by default)."""
        self.dim = self._vector_dim()
        if self.dim is None:
            self._make_vectors(self.meta().get("embedder", {}).get("dim", DIM))

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
                self._put_vector(event_id, _vector(vector, self.dim))
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
        self._exec(f"INSERT INTO meta (key, value) VALUES ({p}, {p}) ON CONFLICT (key) DO UPDATE SET value = "
                   f"excluded.value", [key, json.dumps(value)])

    def record_failure(self, query: str, error: str) -> None:
        """A query whose endpoint call failed for good (after the client's retries)."""
        with self._tx():
            self._exec(f"INSERT INTO failures (query, error) VALUES ({self.P}, {self.P})", [query, error[:2000]])

    def failures(self) -> list[dict]:
        return [{"id": i, "query": q, "error": e} for i, q, e in
                self._exec("SELECT id, query, error FROM failures ORDER BY id")]

    def bind_embedder(self, embedder) -> None:
        """Record ``embedder`` (its :meth:`~halwatch.watchdog.embed.Embedder.record`) as the store's, or refuse it
        when the store's points were embedded by another model."""
        mine = self.meta().get("embedder")
        theirs = embedder.record()
        if mine is None:
            if self.count():
                mine = {"name": DEFAULT, "dim": self.dim}  # a store from before embedders were recorded
            else:
                if theirs["dim"] != self.dim:
                    self._make_vectors(theirs["dim"], replace=True)
                self.set_meta(embedder=theirs)
                return
        if mine.get("name") != theirs["name"] or mine.get("hash", theirs["hash"]) != theirs["hash"]:
            raise StoreError(f"the store {self.uri} was embedded with {mine.get('name')} (hash {mine.get('hash')}), "
                             f"not {theirs['name']} (hash {theirs['hash']}): use --embedder {mine.get('name')}, or "
                             f"another store")
        if "hash" not in mine:
            self.set_meta(embedder=theirs)

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

    def vectors(self) -> tuple[list[int], np.ndarray]:
        """Every boundary point's id and unit vector, in id order."""
        raise NotImplementedError

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


#: The most neighbours one sqlite-vec KNN query returns (its own limit, ``k value in knn query too large``).
KNN_LIMIT = 4096


def _vector(vector, dim: int = DIM) -> np.ndarray:
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    if v.shape != (dim,) or not np.isfinite(v).all() or not np.linalg.norm(v) > 0:
        raise StoreError(f"a point's embedding must be {dim} finite numbers, not all zero")
    return v / np.linalg.norm(v)


def redact(uri: str) -> str:
    """``uri`` with the password of its user part (``user:password@``) and of a ``password=`` parameter hidden."""
    import re

    uri = re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", uri)
    return re.sub(r"(password=)[^&\s]*", r"\1***", uri, flags=re.IGNORECASE)


class SqliteStore(Store):
    def __init__(self, path: str | Path):
        import apsw
        import sqlite_vec

        self.uri = f"sqlite:{path}"
        path = Path(path)
        if path.is_dir():
            raise StoreError(f"{path} is a folder, not a database file")
        path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                self._open(path, apsw, sqlite_vec)
                return
            except apsw.Error as exc:
                if getattr(self, "_db", None) is not None:
                    self._db.close()  # no connection is left open by a failed attempt
                # Two processes that open a new store at once both switch it to WAL: each holds a shared lock and
                # wants an exclusive one, and SQLite answers one of them "busy" at once instead of letting both wait
                # for ever. Start again after a short random pause, up to the deadline; any other error is final.
                if not isinstance(exc, apsw.BusyError) or time.monotonic() > deadline:
                    raise StoreError(f"cannot open {path} as a store: {exc}") from None
                time.sleep(random.uniform(0.02, 0.2))

    def _open(self, path: Path, apsw, sqlite_vec) -> None:
        self._db = apsw.Connection(str(path))
        # Wait for another writer's lock before anything else: the journal-mode switch below needs a lock too.
        self._db.set_busy_timeout(10000)
        self._db.enable_load_extension(True)
        self._db.load_extension(sqlite_vec.loadable_path())
        self._db.enable_load_extension(False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._init_tables("INTEGER", "REAL")
        self._init_vectors()

    def _vector_dim(self) -> int | None:
        import re

        rows = self._exec("SELECT sql FROM sqlite_master WHERE name = 'vectors'")
        return int(re.search(r"float\[(\d+)\]", rows[0][0]).group(1)) if rows else None

    def _make_vectors(self, dim: int, replace: bool = False) -> None:
        with self._tx():
            if replace:
                self._exec("DROP TABLE IF EXISTS vectors")
            self._exec(f"CREATE VIRTUAL TABLE IF NOT EXISTS vectors USING vec0(embedding float[{int(dim)}] "
                       f"distance_metric=cosine)")
        self.dim = int(dim)

    @contextlib.contextmanager
    def _tx(self):
        """A transaction that takes the write lock when it begins (``BEGIN IMMEDIATE``), waiting for another
        process's lock up to the busy timeout. A deferred transaction that reads first (``CREATE TABLE IF NOT
        EXISTS``, an upsert) and writes later fails at once with "database is locked" when another process commits
        in between: its snapshot is stale, and SQLite does not wait then."""
        if self._db.in_transaction:
            yield self._db
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _exec(self, sql, args=()):
        return list(self._db.execute(sql, args))

    def _insert_id(self, sql, args) -> int:
        self._db.execute(sql, args)
        return int(self._db.last_insert_rowid())

    def _put_vector(self, point_id, v) -> None:
        self._db.execute("INSERT INTO vectors (rowid, embedding) VALUES (?, ?)", [point_id, v.tobytes()])

    def nearest(self, vector, k: int):
        """sqlite-vec answers a KNN query for at most ``KNN_LIMIT`` neighbours; past that (a store of more points, asked
        for more of them) the answer is an exact scan of every stored vector, the same cosine similarity in float64."""
        n = self.count()
        if k < 1 or not n:
            return []
        query, k = _vector(vector, self.dim), min(int(k), n)
        if k > KNN_LIMIT:
            ids, matrix = self.vectors()
            similarity = matrix.astype(np.float64) @ query.astype(np.float64)
            order = np.argsort(-similarity, kind="stable")[:k]
            return [(self.point(ids[i]), float(similarity[i]), matrix[i]) for i in order]
        rows = self._exec("SELECT rowid, distance, embedding FROM vectors WHERE embedding MATCH ? AND k = ? "
                          "ORDER BY distance", [query.tobytes(), k])
        return [(self.point(r), 1.0 - float(d), np.frombuffer(e, dtype=np.float32)) for r, d, e in rows]

    def vectors(self):
        rows = self._exec("SELECT rowid, embedding FROM vectors ORDER BY rowid")
        return [int(r) for r, _ in rows], np.array([np.frombuffer(e, dtype=np.float32) for _, e in rows],
                                                   dtype=np.float32).reshape(len(rows), self.dim)

    def integrity(self) -> str:
        return str(self._exec("PRAGMA integrity_check")[0][0])

    def close(self) -> None:
        self._db.close()


class PgStore(Store):
    P = "%s"

    def __init__(self, uri: str, server=None):
        import psycopg

        self.uri, self._server = redact(uri), server
        try:
            self._db = psycopg.connect(uri, autocommit=True, connect_timeout=10)
            self._db.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except psycopg.Error as exc:
            message = redact(str(exc).strip().splitlines()[0])
            raise StoreError(f"cannot open the PostgreSQL store {self.uri}: {message}") from None
        self._init_tables("BIGSERIAL", "DOUBLE PRECISION")
        self._init_vectors()

    def _vector_dim(self) -> int | None:
        rows = self._exec("SELECT atttypmod FROM pg_attribute WHERE attrelid = to_regclass('vectors') "
                          "AND attname = 'embedding'")
        return int(rows[0][0]) if rows else None

    def _make_vectors(self, dim: int, replace: bool = False) -> None:
        with self._tx():
            if replace:
                self._exec("DROP TABLE IF EXISTS vectors")
            self._exec(f"CREATE TABLE IF NOT EXISTS vectors (id BIGINT PRIMARY KEY REFERENCES points(id), "
                       f"embedding vector({int(dim)}) NOT NULL)")
            self._exec("CREATE INDEX IF NOT EXISTS vectors_hnsw ON vectors USING hnsw (embedding vector_cosine_ops)")
        self.dim = int(dim)

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
        """Through the HNSW index (approximate) for the few neighbours the monitor asks for, its candidate list
        (``hnsw.ef_search``) at least four times ``k``; for more than 100 the search is exact (no index), since an
        HNSW scan may return fewer points than asked."""
        with self._tx():
            self._exec(f"SET LOCAL hnsw.ef_search = {min(1000, max(40, 4 * int(k)))}")
            if k > 100:
                self._exec("SET LOCAL enable_indexscan = off")
            rows = self._exec("SELECT id, embedding <=> %s::vector AS d, embedding::text FROM vectors ORDER BY d "
                              "LIMIT %s", [_literal(_vector(vector, self.dim)), int(k)])
        return [(self.point(r), 1.0 - float(d), np.array(json.loads(e), dtype=np.float32)) for r, d, e in rows]

    def vectors(self):
        rows = self._exec("SELECT id, embedding::text FROM vectors ORDER BY id")
        return [int(r) for r, _ in rows], np.array([json.loads(e) for _, e in rows],
                                                   dtype=np.float32).reshape(len(rows), self.dim)

    def uses_index(self) -> bool:
        """Whether PostgreSQL plans the nearest-neighbour search with the HNSW index (sequential scans off)."""
        with self._tx():
            self._exec("SET LOCAL enable_seqscan = off")
            plan = self._exec("EXPLAIN SELECT id FROM vectors ORDER BY embedding <=> %s::vector LIMIT 3",
                              [_literal(np.ones(self.dim) / np.sqrt(self.dim))])
        return any("vectors_hnsw" in row[0] for row in plan)

    def integrity(self) -> str:
        orphans = self._exec("SELECT COUNT(*) FROM points p LEFT JOIN vectors v ON v.id = p.id WHERE v.id IS NULL")
        return "ok" if orphans[0][0] == 0 else f"{orphans[0][0]} points without a vector"

    def close(self) -> None:
        self._db.close()
        if self._server is not None:
            self._server.cleanup()


def _literal(v) -> str:
    return "[" + ",".join(f"{x:.8g}" for x in v) + "]"


def open_store(uri: str, create: bool = True) -> Store:
    """Open the store at ``uri``: ``sqlite:PATH``, ``PATH.db``, ``postgresql://...`` or ``pgserver:DIR``; a file or
    data folder that does not exist yet is created, or with ``create=False`` (the commands that only read a store)
    refused without writing anything."""
    uri = str(uri).strip()
    if uri.startswith("sqlite:") or (uri.endswith((".db", ".sqlite", ".sqlite3")) and "://" not in uri):
        path = uri[len("sqlite:"):].removeprefix("//") if uri.startswith("sqlite:") else uri
        if not path:
            raise StoreError("sqlite: needs a file path, e.g. sqlite:boundary.db")
        _exists(path, create)
        return SqliteStore(path)
    if uri.startswith(("postgresql://", "postgres://")):
        return PgStore(uri)
    if uri.startswith("pgserver:"):
        import logging
        import warnings

        folder = uri[len("pgserver:"):].removeprefix("//")
        if not folder:
            raise StoreError("pgserver: needs a data folder, e.g. pgserver:./pgdata")
        _exists(folder, create)
        logging.getLogger("pgserver").setLevel(logging.ERROR)
        with warnings.catch_warnings():  # platformdirs' note that XDG_RUNTIME_DIR is unset: noise here
            warnings.simplefilter("ignore")
            import pgserver

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
    import subprocess

    from pgserver.postgres_server import pg_ctl

    data = Path(folder).resolve()
    if not (data / "postmaster.pid").exists():
        return False
    user = "pgserver" if os.geteuid() == 0 else None
    try:
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=data, user=user)
    except subprocess.CalledProcessError:
        # its last opener's own stop may have got there first (the PID file is read, then the server is gone)
        try:
            pg_ctl(["status"], pgdata=data, user=user)
        except subprocess.CalledProcessError:  # pg_ctl status exits 3 when no server runs there: stopped
            return False
        raise
    return True


def _exists(path: str, create: bool) -> None:
    """Refuse a store's file or folder that is not there when it may not be created."""
    if not create and not Path(path).exists():
        raise StoreError(f"no store at {path}: run `halwatch watch explore --store {path}` first")
