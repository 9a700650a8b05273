// Package sql holds stagedrain's schema, embedded into the binary: four
// kinds of file, told apart by name only.
//
//   - NNN_name.sql is one migration, applied once per schema in version
//     order by relay.Migrate and recorded in the schema's
//     stagedrain_migrations table under its file name. Together they are the
//     upgrade path from any earlier release (and from the seed article's
//     table). A released migration is never edited.
//   - baseline_NNN.sql is the schema at version NNN in one file: what a
//     fresh schema (no version recorded, no staged_jobs table) gets instead
//     of migrations 001..NNN, which Migrate then records as applied, under
//     their names. Later migrations apply on top of it, so adding one does
//     not touch the baseline. A test holds a fresh install and an upgrade
//     from 001 to the same catalog.
//   - wake_NNN.sql is the stagedrain_wake() trigger function as migration
//     NNN defines it, alone: the baseline's trigger runs it, and Migrate
//     with relay.WithSource(relay.SourceSidekiqStagedPush) installs the one
//     of the highest NNN on the gem's table. A migration that changes the
//     function adds its wake file; a test fails until it does.
//   - gem_NNN.sql is what Migrate WithSource(SourceSidekiqStagedPush) adds
//     to the gem's table besides the wake trigger (the low-water mark's
//     statement trigger), recorded in its trigger's comment; the highest
//     NNN is installed.
//
// Files use unqualified names: Migrate sets the search_path to the target
// schema for the migration's transaction, so the schema name is quoted in
// exactly one place.
package sql

import "embed"

// Files holds the migration, baseline and wake files.
//
//go:embed *.sql
var Files embed.FS
