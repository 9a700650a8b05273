package target

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// Tenant is what a relay of one schema writes into each job with
// Config.TenantKey: the key and the schema's name (relay/tenant.go says
// where each job system's workers read it). The zero value writes nothing.
type Tenant struct {
	key    string // Config.TenantKey; "" off
	schema string
	// field is `,"<key>":"<schema>"`, the tag as a member of a JSON
	// object (a Sidekiq job hash), built once.
	field []byte
}

// NewTenant is the tenant of a relay of schema, written under key; none
// when key is "".
func NewTenant(key, schema string) Tenant {
	if key == "" {
		return Tenant{}
	}
	f := AppendJSONString([]byte{','}, key)
	f = append(f, ':')
	return Tenant{key: key, schema: schema, field: AppendJSONString(f, schema)}
}

func (t Tenant) on() bool { return t.key != "" }

// check returns why a row whose decoded options are opts cannot go to this
// tenant: they name another tenant under the key. nil when they name none,
// or this one.
func (t Tenant) check(opts map[string]json.RawMessage) error {
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
		t.key, Truncate(string(raw), 80), t.schema)
}

// checkName is check for a tenant name the row gives, where says how.
func (t Tenant) checkName(name, where string) error {
	if name == t.schema {
		return nil
	}
	return fmt.Errorf("tenant mismatch: %s tenant %q under %q, but it was staged in schema %q",
		where, Truncate(name, 80), t.key, t.schema)
}
