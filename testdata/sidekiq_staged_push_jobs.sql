-- The table of the sidekiq-staged_push gem, as its migration makes it
-- (create_table :sidekiq_staged_push_jobs with t.json :payload,
-- null: false and t.timestamps): the source SourceSidekiqStagedPush drains.
-- Tests create it in their own schema, naming it schema-qualified in place
-- of the bare name below.
CREATE TABLE sidekiq_staged_push_jobs (
    id bigserial PRIMARY KEY,
    payload json NOT NULL,
    created_at timestamp(6) without time zone NOT NULL,
    updated_at timestamp(6) without time zone NOT NULL
);
