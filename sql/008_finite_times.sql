-- run_at and created_at finite: PostgreSQL takes 'infinity' and '-infinity'
-- for a TIMESTAMPTZ (Rails writes 'infinity' for Float::INFINITY), but no
-- Go time, epoch score or job system's timestamp can hold them, so no
-- worker could ever run such a row. From now on an INSERT (or UPDATE) of
-- one fails in the app's own transaction, naming the constraint:
-- staged_jobs_run_at_finite or staged_jobs_created_at_finite.
--
-- Existing rows: untouched. The constraints are added NOT VALID, so this
-- migration neither scans the table nor fails on a row that breaks them;
-- the relay dead-letters such a row when it claims it (staged_jobs_dead,
-- reason "run_at is infinity: ...", the value kept as staged), and the
-- rows behind it flow on. Once the table holds none, an operator may run
-- ALTER TABLE staged_jobs VALIDATE CONSTRAINT ... for each; the relay does
-- not need it.
--
-- staged_jobs_dead gets no such constraint: it must hold the rows that die
-- for it. `stagedrain dead retry` of one fails on this constraint until its
-- run_at or created_at is fixed.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass AND conname = 'staged_jobs_run_at_finite') THEN
        ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_run_at_finite
            CHECK (run_at IS NULL OR isfinite(run_at)) NOT VALID;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass AND conname = 'staged_jobs_created_at_finite') THEN
        ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_created_at_finite
            CHECK (isfinite(created_at)) NOT VALID;
    END IF;
END
$$;
