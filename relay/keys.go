package relay

import (
	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// The relay's own Redis keys, its fence and record hashes, are built here.
// Each target builds its keys in its file of relay/internal/target (a
// user's workers find jobs only if they match their job system's layout).

// newHandoffKeys returns the relay's own Redis keys, for one schema of one
// database, under the namespace: the fence hash and the record hash (the
// handoff derives each cluster slot's pair from them). A group of relays
// with Config.Queues has its own (group is its sorted queue list,
// comma-joined; "" for the relays of all queues): the leaders of two
// groups lead at the same time and must not fence each other.
func newHandoffKeys(namespace, database, schema, group string) handoff.Keys {
	base := "stagedrain:" + database + ":" + schema + ":"
	if group != "" {
		base += "queues=" + group + ":"
	}
	if namespace != "" {
		base = namespace + ":" + base
	}
	return handoff.Keys{Fence: base + "fence", Record: base + "handoff"}
}
