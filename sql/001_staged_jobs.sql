-- staged_jobs: rows an application INSERTs inside its own transaction; the
-- relay pushes committed rows to Redis and deletes them.
--
-- Written so that it also upgrades the seed article's minimal table
-- (id, job_name, job_args) in place: every later column is added only if missing.

CREATE TABLE IF NOT EXISTS staged_jobs (
    id       BIGSERIAL PRIMARY KEY,
    job_name TEXT  NOT NULL,
    job_args JSONB NOT NULL
);

-- queue: the Sidekiq queue the job is pushed to.
ALTER TABLE staged_jobs ADD COLUMN IF NOT EXISTS queue TEXT NOT NULL DEFAULT 'default';
-- run_at: NULL (or a time not in the future) means run now; a future time
-- makes a scheduled job.
ALTER TABLE staged_jobs ADD COLUMN IF NOT EXISTS run_at TIMESTAMPTZ;
-- jid: Sidekiq's job id, 24 lowercase hex characters (96 random bits), fixed at
-- INSERT so the app can read it through RETURNING and every redelivery carries it.
ALTER TABLE staged_jobs ADD COLUMN IF NOT EXISTS jid TEXT NOT NULL
    DEFAULT substr(md5(gen_random_uuid()::text), 1, 24);
-- created_at: when the job was staged (the INSERT statement's start).
ALTER TABLE staged_jobs ADD COLUMN IF NOT EXISTS created_at TIMESTAMPTZ NOT NULL
    DEFAULT statement_timestamp();
-- options: extra Sidekiq payload fields (retry, tags, backtrace, ...) merged
-- into the pushed job.
ALTER TABLE staged_jobs ADD COLUMN IF NOT EXISTS options JSONB NOT NULL DEFAULT '{}';

-- Reject, inside the app's own transaction, what no worker could run.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass AND conname = 'staged_jobs_job_name_check') THEN
        ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_job_name_check
            CHECK (job_name <> '');
    END IF;
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass AND conname = 'staged_jobs_queue_check') THEN
        ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_queue_check
            CHECK (queue <> '');
    END IF;
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass AND conname = 'staged_jobs_job_args_check') THEN
        ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_job_args_check
            CHECK (jsonb_typeof(job_args) = 'array');
    END IF;
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass AND conname = 'staged_jobs_jid_check') THEN
        ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_jid_check
            CHECK (jid <> '');
    END IF;
    -- The keys the relay writes from columns cannot be overridden by options.
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass AND conname = 'staged_jobs_options_check') THEN
        ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_options_check
            CHECK (jsonb_typeof(options) = 'object'
                   AND NOT options ?| ARRAY['class', 'args', 'queue', 'jid', 'created_at', 'enqueued_at', 'at']);
    END IF;
END
$$;

-- Wake the relay when a staging transaction commits. pg_notify is
-- transactional: the notification is sent at COMMIT, never on ROLLBACK, and
-- identical notifications of one transaction are sent once. The channel is
-- derived from the table's schema, so relays of two schemas never wake each
-- other; relay.ChannelName computes the same name.
CREATE OR REPLACE FUNCTION stagedrain_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(
        CASE WHEN octet_length('stagedrain_' || TG_TABLE_SCHEMA) <= 63
             THEN 'stagedrain_' || TG_TABLE_SCHEMA
             ELSE 'stagedrain_' || md5(TG_TABLE_SCHEMA)
        END,
        '');
    RETURN NULL;
END
$$;

-- Statement level: one trigger call per INSERT statement, not per row.
CREATE OR REPLACE TRIGGER stagedrain_notify
    AFTER INSERT ON staged_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION stagedrain_notify();
