package relay

import (
	"slices"
	"strings"

	targets "github.com/stagedrain/stagedrain/relay/internal/target"
)

// A job knows its tenant (Config.TenantKey): each target writes the name of
// the schema a row was staged in into the job, under the key, where that
// job system's workers read per-job metadata:
//
//   - sidekiq: a top-level key of the job hash, as every option is. That
//     is where apartment-sidekiq's server middleware reads it
//     (Apartment::Tenant.switch(item['apartment']) before perform), and a
//     plain-Ruby middleware of acts_as_tenant or penthouse alike.
//   - asynq: a header of the task (TaskMessage field 15, Task.Headers() in
//     v0.26.0), beside the "headers" option; the payload stays the
//     job_args JSON text.
//   - streams: a field of the entry, after created_at.
//   - celery: a header of the task message, after any "headers" option's;
//     the worker sets it on task.request (self.request.<key>).
//
// The relay knows the schema for certain; the app may have forgotten to
// stage its tenant, or staged the wrong one. A row whose options already
// name a tenant under the key (for asynq: its "headers" option too) passes
// if that is its own schema, and is poison otherwise: a job of one tenant
// that would run against another's data is dead-lettered, with a reason
// naming both (the gem's table, which has no dead-letter table, keeps it
// staged and skips it, as its other poison).

// tenantTag is what a relay of one schema writes into each job: the key
// and the schema's name (target.Tenant). The zero value writes nothing.
type tenantTag = targets.Tenant

func newTenantTag(key, schema string) tenantTag { return targets.NewTenant(key, schema) }

// tenantKeysOwned are the keys target's format gives a meaning of its own
// (its Spec's OwnedKeys): Config.TenantKey may not be one of them.
func tenantKeysOwned(target Target) []string { return target.spec().OwnedKeys }

// validateTenantKey checks Config.TenantKey for target.
func validateTenantKey(key string, target Target) error {
	switch {
	case key == "":
		return nil
	case strings.TrimSpace(key) != key || strings.ContainsFunc(key, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return fieldErr("TenantKey", "must be a key name without control characters or surrounding spaces, got %q", key)
	case slices.Contains(tenantKeysOwned(target), key):
		return fieldErr("TenantKey", "%q is a key the %s target's format owns (%s): choose another, such as \"apartment\"",
			key, target, strings.Join(tenantKeysOwned(target), ", "))
	}
	return nil
}
