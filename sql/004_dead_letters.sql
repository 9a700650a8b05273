-- staged_jobs_dead: rows the relay can never push (poison), moved here in
-- the drain's own transaction so that the rows behind them flow on. A row
-- keeps its id and every column as it was staged (NULLs included: a table
-- made by hand may allow them, and such a row is poison), plus why it died,
-- when, and how many pushes were tried. `stagedrain dead` lists, retries
-- (moves back into staged_jobs, keeping id and jid) and purges them.
CREATE TABLE IF NOT EXISTS staged_jobs_dead (
    id         BIGINT PRIMARY KEY,
    job_name   TEXT,
    job_args   JSONB,
    queue      TEXT,
    run_at     TIMESTAMPTZ,
    jid        TEXT,
    created_at TIMESTAMPTZ,
    options    JSONB,
    -- reason: the payload check, the size limit or Redis's error reply.
    reason     TEXT        NOT NULL,
    failed_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- attempts: pushes tried before the row died. Poison is not retried, so
    -- the relay writes 1; a row moved back by `dead retry` starts over; one
    -- that dies again while its dead row is still there counts one more.
    attempts   INT         NOT NULL
);
