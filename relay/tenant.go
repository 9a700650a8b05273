package relay

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
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
// and the schema's name. The zero value writes nothing.
type tenantTag struct {
	key    string // Config.TenantKey; "" off
	schema string
	// field is `,"<key>":"<schema>"`, the tag as a member of a Sidekiq
	// job hash, built once.
	field []byte
}

func newTenantTag(key, schema string) tenantTag {
	if key == "" {
		return tenantTag{}
	}
	f := appendJSONString([]byte{','}, key)
	f = append(f, ':')
	return tenantTag{key: key, schema: schema, field: appendJSONString(f, schema)}
}

func (t tenantTag) on() bool { return t.key != "" }

// check returns why a row whose decoded options are opts cannot go to this
// tenant: they name another tenant under the key. nil when they name none,
// or this one.
func (t tenantTag) check(opts map[string]json.RawMessage) error {
	if t.key == "" {
		return nil
	}
	raw, ok := opts[t.key]
	if !ok {
		return nil
	}
	var s string
	if raw = bytes.TrimSpace(raw); len(raw) > 0 && raw[0] == '"' && json.Unmarshal(raw, &s) == nil {
		return t.checkName(s, "the job names")
	}
	return fmt.Errorf("tenant mismatch: the job sets %q to %s, not to the name of the schema it was staged in, %q",
		t.key, truncate(string(raw), 80), t.schema)
}

// checkName is check for a tenant name the row gives, where says how.
func (t tenantTag) checkName(name, where string) error {
	if name == t.schema {
		return nil
	}
	return fmt.Errorf("tenant mismatch: %s tenant %q under %q, but it was staged in schema %q",
		where, truncate(name, 80), t.key, t.schema)
}

// tenantKeysOwned are, by target, the keys the target's format gives a
// meaning of its own: Config.TenantKey may not be one of them.
func tenantKeysOwned(target Target) []string {
	switch target {
	case TargetAsynq:
		// The options the target maps (a tenant key among them would be
		// read as both), and the headers it writes.
		return []string{"retry", "timeout", "deadline", "retention", "unique", "headers", traceparentKey, tracestateKey}
	case TargetBullMQ:
		return bullmqOwnedKeys()
	case TargetStreams:
		return []string{"jid", "class", "args", "queue", "created_at", "options", traceparentKey, tracestateKey}
	case TargetCelery:
		// The protocol's headers and the options the target maps.
		return append(slices.Clone(celeryProtocolHeaders), celeryOptions...)
	default:
		// Those the relay writes, and those Sidekiq (6.4 to 8) and its
		// ActiveJob adapter write or read in a job hash.
		return []string{"class", "args", "queue", "jid", "retry", "created_at", "enqueued_at", "at",
			"wrapped", "retry_count", "retry_queue", "retry_for", "retried_at", "failed_at", "error_message",
			"error_class", "error_backtrace", "backtrace", "dead", "tags", "bid", "log_level", "cattr",
			traceparentKey, tracestateKey}
	}
}

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
