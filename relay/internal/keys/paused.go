// Package keys holds the Redis keys that the relay (package relay) and its
// admin operations (package relay/admin) both use. It imports neither of
// them.
package keys

// Paused is the hash in which the leaders of one schema of one database
// publish what backpressure pauses, under the namespace: field a queue
// ("*" for Redis's memory, which pauses every queue), value the reason.
// The relays of every group of Config.Queues share it (their queues are
// disjoint); it is one key, so any cluster slot will do.
func Paused(namespace, database, schema string) string {
	k := "stagedrain:" + database + ":" + schema + ":paused"
	if namespace != "" {
		k = namespace + ":" + k
	}
	return k
}
