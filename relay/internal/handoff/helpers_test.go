package handoff

import "flag"

// newHandoffKeys names a handoff's keys for a test: the fence and record
// of one schema (and group), under the namespace, as the relay names them.
func newHandoffKeys(namespace, database, schema, group string) Keys {
	base := "stagedrain:" + database + ":" + schema + ":"
	if group != "" {
		base += "queues=" + group + ":"
	}
	if namespace != "" {
		base = namespace + ":" + base
	}
	return Keys{Fence: base + "fence", Record: base + "handoff"}
}

// replyErr is an error reply from Redis, as go-redis hands it over.
type replyErr string

func (e replyErr) Error() string { return string(e) }
func (replyErr) RedisError()     {}

// update is the golden tests' flag: go test ./... -update passes it to
// every test package of the module, and this one has no golden files.
var _ = flag.Bool("update", false, "rewrite the golden files (none here)")
