// Package admin reads and changes a stagedrain schema as an operator does,
// from PostgreSQL (and, for ReadPaused, Redis) alone: no relay need run,
// and none is disturbed. The stagedrain command's status, dead and
// --schemas handling are these functions and a printer; an application
// that runs relays (package relay) needs none of them.
//
//   - ReadStatus: a schema's backlog by queue, its dead letters and the
//     leader of each group of relays (ReadGroups alone is cheap enough
//     for a probe).
//   - ListDead, RetryDead and PurgeDead: the rows of staged_jobs_dead, the
//     jobs the relay could never push; RetryDead moves them back into
//     staged_jobs, PurgeDead deletes them.
//   - ReadPaused: what backpressure pauses now, as the leaders publish it
//     in Redis.
//   - ListSchemas: the schemas a list of names and patterns
//     (relay.ParseSchemas) names, as a relay with Config.Schemas finds them.
//
// Each takes a DB (a *pgx.Conn, a *pgxpool.Pool, or a pgx.Tx). A table
// that is not there is a *NotMigratedError, which matches
// relay.ErrNotMigrated.
package admin
