"""SQLite schema of the clawbridge store, as an ordered list of migrations.

Invariants:
- `MIGRATIONS[i]` takes a database at schema version i to version i + 1; applied in one
  transaction each, so a crash mid-migration leaves the previous version intact.
- Migrations are append-only: a released migration is never edited.
- Token ids are stored as little-endian uint32 blobs and logprobs as float64 blobs
  (`clawbridge.store.codec`), so what was sampled is stored bit for bit.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # v1: sessions, turns, rewards, and the tables the trainer fills.
    """
    CREATE TABLE sessions (
        session_id   TEXT PRIMARY KEY,
        key_hash     TEXT UNIQUE,          -- sha256 of the session key from /rl/start_session
        task_id      TEXT,
        source       TEXT NOT NULL,        -- header | session_key | url | openclaw_runtime | implicit
        status       TEXT NOT NULL,        -- active | ended
        end_reason   TEXT,                 -- end_session | done_header | idle | replaced | single_call
        created_at   REAL NOT NULL,
        updated_at   REAL NOT NULL,
        ended_at     REAL
    );
    CREATE INDEX sessions_status ON sessions(status, updated_at);

    CREATE TABLE turns (
        turn_id              TEXT PRIMARY KEY,
        session_id           TEXT NOT NULL REFERENCES sessions(session_id),
        seq                  INTEGER NOT NULL,
        turn_type            TEXT NOT NULL,   -- main | side
        status               TEXT NOT NULL,   -- ok | cancelled | error
        model                TEXT NOT NULL,
        prompt_token_ids     BLOB NOT NULL,
        completion_token_ids BLOB NOT NULL,
        completion_logprobs  BLOB NOT NULL,
        policy_version       INTEGER NOT NULL,
        finish_reason        TEXT,
        request_json         TEXT NOT NULL,
        response_json        TEXT,
        meta_json            TEXT,             -- turn id / trigger headers, client, stream flag
        prompt_tokens        INTEGER NOT NULL,
        completion_tokens    INTEGER NOT NULL,
        created_at           REAL NOT NULL,
        first_token_at       REAL,
        completed_at         REAL NOT NULL,
        UNIQUE (session_id, seq)
    );

    CREATE TABLE rewards (
        reward_id   INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id  TEXT NOT NULL REFERENCES sessions(session_id),
        turn_id     TEXT REFERENCES turns(turn_id),   -- NULL: a reward for the whole session
        value       REAL NOT NULL,
        source      TEXT NOT NULL,                    -- api | cli | judge | ...
        created_at  REAL NOT NULL
    );
    CREATE INDEX rewards_session ON rewards(session_id);

    CREATE TABLE steps (
        step            INTEGER PRIMARY KEY,
        policy_version  INTEGER,
        status          TEXT NOT NULL,       -- running | ok | failed
        metrics_json    TEXT,
        error           TEXT,
        started_at      REAL NOT NULL,
        finished_at     REAL
    );

    CREATE TABLE samples (
        turn_id         TEXT PRIMARY KEY REFERENCES turns(turn_id),
        session_id      TEXT NOT NULL,
        policy_version  INTEGER NOT NULL,
        consumed_step   INTEGER REFERENCES steps(step),   -- NULL until a step succeeded with it
        dropped_reason  TEXT,                             -- e.g. stale
        created_at      REAL NOT NULL
    );
    CREATE INDEX samples_unconsumed ON samples(consumed_step, dropped_reason);
    """,
    # v2: rewards from conversation (clawbridge.rewards): next states, judge votes and verdicts,
    # hindsight hints, teacher logprobs for on-policy distillation, and per-session progress.
    """
    CREATE TABLE next_states (
        turn_id      TEXT PRIMARY KEY REFERENCES turns(turn_id),
        session_id   TEXT NOT NULL,
        kind         TEXT NOT NULL,        -- user | tool | tool+user
        state_json   TEXT NOT NULL,        -- the messages that came next (tool results, user message)
        from_turn_id TEXT,                 -- the later turn whose request carried them
        created_at   REAL NOT NULL
    );
    CREATE INDEX next_states_session ON next_states(session_id);

    CREATE TABLE judgements (
        turn_id      TEXT PRIMARY KEY REFERENCES turns(turn_id),
        session_id   TEXT NOT NULL,
        status       TEXT NOT NULL,        -- running | done | failed
        score        REAL,                 -- majority vote in {-1, 0, 1} (done only)
        mean_vote    REAL,                 -- mean of the votes, failed ones as 0
        attempt      INTEGER NOT NULL,     -- 1 + how many earlier runs were interrupted or failed
        judge_model  TEXT NOT NULL,
        error        TEXT,
        started_at   REAL NOT NULL,
        finished_at  REAL
    );
    CREATE INDEX judgements_session ON judgements(session_id, status);

    CREATE TABLE judge_votes (
        vote_id      INTEGER PRIMARY KEY AUTOINCREMENT,
        turn_id      TEXT NOT NULL REFERENCES turns(turn_id),
        attempt      INTEGER NOT NULL,
        idx          INTEGER NOT NULL,
        score        INTEGER,              -- -1 | 0 | 1, NULL: the vote failed (error or unparseable)
        hint         TEXT,
        text         TEXT,                 -- the judge's full answer
        error        TEXT,
        created_at   REAL NOT NULL
    );
    CREATE INDEX judge_votes_turn ON judge_votes(turn_id, attempt);

    CREATE TABLE hints (
        turn_id      TEXT PRIMARY KEY REFERENCES turns(turn_id),
        hint         TEXT NOT NULL,
        created_at   REAL NOT NULL
    );

    CREATE TABLE teacher_logprobs (
        turn_id      TEXT PRIMARY KEY REFERENCES turns(turn_id),
        logprobs     BLOB NOT NULL,        -- float64 per completion token, teacher = base model + hint
        prompt_len   INTEGER NOT NULL,     -- tokens of the hinted prompt the teacher saw
        created_at   REAL NOT NULL
    );

    CREATE TABLE reward_sessions (
        session_id   TEXT PRIMARY KEY REFERENCES sessions(session_id),
        status       TEXT NOT NULL,        -- done (every main turn with a next state judged)
        turns_judged INTEGER NOT NULL,
        finished_at  REAL NOT NULL
    );
    """,
    # v3: policy versions owned by the store (clawbridge.store.versions): every version ever
    # served is reserved here before it is published, so none repeats across restarts; committed
    # ones name the checkpoint (weights + optimizer state) and what it belongs to.
    """
    CREATE TABLE policy_versions (
        version        INTEGER PRIMARY KEY,
        status         TEXT NOT NULL,       -- reserved | committed | abandoned
        kind           TEXT NOT NULL,       -- base | step | rollback | restore
        step           INTEGER,             -- kind step: the training step that produced it
        source_version INTEGER,             -- rollback | restore: the version whose weights it serves
        checkpoint     TEXT,                -- committed: where its weights and optimizer state are
        identity_json  TEXT,                -- committed: base model, LoRA config, backend
        created_at     REAL NOT NULL,
        committed_at   REAL
    );
    CREATE INDEX policy_versions_status ON policy_versions(status, version);
    ALTER TABLE steps ADD COLUMN checkpoint TEXT;
    """,
    # v4: checkpoint retention (clawbridge.trainer.checkpoints): when a committed version's
    # checkpoint was deleted to keep only the newest ones. The version stays committed (its number
    # is used and recorded turns name it); it can no longer be restored or rolled back to.
    """
    ALTER TABLE policy_versions ADD COLUMN pruned_at REAL;
    """,
    # v5: users (clawbridge.store.users): a user is a name and the sha256 of its key (the key itself
    # is never stored); every session records the user whose key (or trusted X-User-Id) made it.
    """
    CREATE TABLE users (
        user_id      TEXT PRIMARY KEY,     -- the name the admin gave (USER_NAME_RE)
        key_hash     TEXT UNIQUE,          -- sha256 of the user's key, NULL once revoked
        created_at   REAL NOT NULL,
        revoked_at   REAL
    );
    ALTER TABLE sessions ADD COLUMN user_id TEXT;
    CREATE INDEX sessions_user ON sessions(user_id);
    """,
    # v6: promotion (clawbridge.store.promotion): which committed version plain requests get
    # (serving) and which one is on trial (candidate), every decision taken about a candidate
    # (at most one automatic decision per version: the partial unique index), each version's
    # evaluation figures per evaluation set, and the version whose rejection a consumed sample built.
    """
    CREATE TABLE promotion_state (
        id                 INTEGER PRIMARY KEY CHECK (id = 1),
        mode               TEXT NOT NULL,       -- off | eval | canary (the mode that last wrote it)
        serving_version    INTEGER,
        candidate_version  INTEGER,
        candidate_since    REAL,                -- canary: when the candidate started taking new sessions
        canary_share       REAL,
        updated_at         REAL NOT NULL
    );

    CREATE TABLE promotion_decisions (
        decision_id        INTEGER PRIMARY KEY AUTOINCREMENT,
        version            INTEGER NOT NULL,
        verdict            TEXT NOT NULL,       -- promoted | rejected
        source             TEXT NOT NULL,       -- eval | canary | admin
        incumbent_version  INTEGER,             -- the version serving when it was decided
        score              REAL,
        incumbent_score    REAL,
        reason             TEXT NOT NULL,
        figures_json       TEXT,                -- what the decision was taken on (counts, intervals)
        created_at         REAL NOT NULL
    );
    CREATE UNIQUE INDEX promotion_decisions_once ON promotion_decisions(version) WHERE source != 'admin';

    CREATE TABLE promotion_evals (
        version            INTEGER NOT NULL,
        eval_digest        TEXT NOT NULL,       -- sha256 of the evaluation set (items and settings)
        figures_json       TEXT NOT NULL,
        created_at         REAL NOT NULL,
        PRIMARY KEY (version, eval_digest)
    );

    ALTER TABLE samples ADD COLUMN rejected_version INTEGER;
    """,
    # v7: per-user adapters (clawbridge.trainer.lanes): every policy version and training step
    # belongs to one trainer lane, '' for the shared policy, else the user whose adapter it is.
    """
    ALTER TABLE policy_versions ADD COLUMN lane TEXT NOT NULL DEFAULT '';
    ALTER TABLE steps ADD COLUMN lane TEXT NOT NULL DEFAULT '';
    CREATE INDEX policy_versions_lane ON policy_versions(lane, status, version);
    CREATE INDEX steps_lane ON steps(lane, step);
    """,
    # v8: deletions owed on a hosted service (clawbridge.store.deletions): each object a pruned
    # checkpoint or a forgotten user left there, recorded before the first try to delete it and
    # removed once the service confirmed it gone. Names no user (forgetting leaves nothing of hers).
    """
    CREATE TABLE owed_deletions (
        object       TEXT PRIMARY KEY,     -- what names it on the service (a tinker:// path, a client id)
        kind         TEXT NOT NULL,        -- what the backend says it is (RemoteObject.kind)
        backend      TEXT NOT NULL,        -- the backend that stored it (the one that can delete it)
        reason       TEXT NOT NULL,        -- prune | forget
        created_at   REAL NOT NULL,
        attempts     INTEGER NOT NULL DEFAULT 0,
        last_error   TEXT,
        next_try_at  REAL NOT NULL
    );
    CREATE INDEX owed_deletions_due ON owed_deletions(backend, next_try_at);
    """,
    # v9: numbers given once, ever (clawbridge.store.counters): policy versions and steps come from
    # a persisted counter, not from MAX over the rows that still exist (a forget deletes a user
    # lane's versions and steps, which may be the newest). Seeded with the highest number seen so far.
    """
    CREATE TABLE counters (
        name    TEXT PRIMARY KEY,      -- policy_version | step
        value   INTEGER NOT NULL       -- the last number given (the next is value + 1)
    );
    INSERT INTO counters(name, value) SELECT 'policy_version', COALESCE(MAX(v), 0) FROM (
        SELECT MAX(version) AS v FROM policy_versions UNION ALL SELECT MAX(policy_version) FROM turns
        UNION ALL SELECT MAX(policy_version) FROM steps);
    INSERT INTO counters(name, value) SELECT 'step', COALESCE(MAX(step), 0) FROM steps;
    """,
    # v10: notes from talk (clawbridge.rewards.notes): what the judge read in a user's corrections,
    # put in that user's next calls at once while training teaches it to the weights; a turn served
    # with notes keeps the prompt the model saw (prompt_token_ids) and the prompt it trains on
    # (train_prompt_token_ids, the same call without the notes), so the weights learn to answer as
    # the note asked without it. `turn_id` is the corrected turn, so forgetting its user deletes it.
    """
    CREATE TABLE notes (
        note_id      INTEGER PRIMARY KEY AUTOINCREMENT,
        user_id      TEXT NOT NULL DEFAULT '',   -- '' : calls made without a user (the shared client key)
        text         TEXT NOT NULL,
        turn_id      TEXT,                       -- the corrected turn it came from (its hint)
        status       TEXT NOT NULL,              -- active | retired
        corrections  INTEGER NOT NULL DEFAULT 1, -- corrections with this same text
        created_at   REAL NOT NULL,
        updated_at   REAL NOT NULL,
        retired_at   REAL,
        retired_reason TEXT
    );
    CREATE INDEX notes_user ON notes(user_id, status);
    ALTER TABLE turns ADD COLUMN train_prompt_token_ids BLOB;
    """,
    # v11: a rollback by the admin holds (clawbridge.store.promotion): the version rolled back to
    # serves and no training step runs until the admin resumes.
    """
    ALTER TABLE promotion_state ADD COLUMN held_version INTEGER;
    ALTER TABLE promotion_state ADD COLUMN held_since REAL;
    """,
    # v12: a turn served with notes is scored twice for OPD: the teacher (base model, plain prompt +
    # hint) and the reference it is measured against (base model, the plain prompt it trains on). Its
    # sampled logprobs were taken with the note in the context, so they already carry the hint.
    """
    ALTER TABLE teacher_logprobs ADD COLUMN reference_logprobs BLOB;
    """,
    # v13: the judge's rewrite of a corrected answer (what the user asked for, written out), trained
    # as a demonstration on the turn's plain prompt (clawbridge.rewards.rewrites). The ids are the
    # rewrite as the served tokenizer encodes it; the logprobs are the base model's on that prompt.
    """
    CREATE TABLE rewrites (
        turn_id              TEXT PRIMARY KEY REFERENCES turns(turn_id),
        text                 TEXT NOT NULL,
        completion_token_ids BLOB,            -- NULL until scored
        logprobs             BLOB,            -- float64 per id: the base model on the trained prompt
        created_at           REAL NOT NULL,
        scored_at            REAL
    );
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)
