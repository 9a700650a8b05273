-- job_name and job_args NOT NULL: 001 creates them so, but leaves the
-- columns of a seed table it upgrades as they were, and the seed article's
-- table may have them nullable. One NULL row would stop every drain.
--
-- Only when a column is still nullable: SET NOT NULL takes an ACCESS
-- EXCLUSIVE lock (within Migrate's lock_timeout) and scans the table under
-- it (staged_jobs is small while a relay drains it), which an install
-- created by 001 need not pay. Both columns are checked in one scan. Rows
-- with a NULL fail the migration, and with it the whole transaction,
-- saying how many there are and how to find them.
DO $$
DECLARE
    nulls bigint;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_attribute
                   WHERE attrelid = 'staged_jobs'::regclass
                     AND attname IN ('job_name', 'job_args') AND NOT attnotnull) THEN
        RETURN;
    END IF;
    ALTER TABLE staged_jobs
        ALTER COLUMN job_name SET NOT NULL,
        ALTER COLUMN job_args SET NOT NULL;
EXCEPTION WHEN not_null_violation THEN
    SELECT count(*) INTO nulls FROM staged_jobs WHERE job_name IS NULL OR job_args IS NULL;
    RAISE EXCEPTION USING
        ERRCODE = 'not_null_violation',
        MESSAGE = format('%s %s of %I.staged_jobs %s a NULL job_name or job_args, which no worker could run: '
                         'find them with SELECT id FROM %I.staged_jobs WHERE job_name IS NULL OR job_args IS NULL, '
                         'fix or delete them, and run migrate again',
                         nulls, CASE nulls WHEN 1 THEN 'row' ELSE 'rows' END, current_schema(),
                         CASE nulls WHEN 1 THEN 'has' ELSE 'have' END, current_schema());
END
$$;
