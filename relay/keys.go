package relay

import (
	"crypto/md5"
	"encoding/hex"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// Every Redis key the relay writes is built here: the targets' keys (a
// user's workers find jobs only if these match their job system's layout)
// and the relay's own fence and record hashes. The celery target keeps its
// keys in celery.go, so that a target is one file.

// sidekiqKeys builds the keys the Sidekiq target writes.
type sidekiqKeys struct {
	prefix string // "" or "<namespace>:"
}

func newSidekiqKeys(namespace string) sidekiqKeys {
	if namespace == "" {
		return sidekiqKeys{}
	}
	return sidekiqKeys{prefix: namespace + ":"}
}

// queues is the set of queue names Sidekiq's UI and workers know about.
func (k sidekiqKeys) queues() string { return k.prefix + "queues" }

// queue is the list a queue's immediate jobs are LPUSHed to; workers BRPOP it.
func (k sidekiqKeys) queue(name string) string { return k.prefix + "queue:" + name }

// schedule is the sorted set of scheduled jobs, scored by float epoch seconds.
func (k sidekiqKeys) schedule() string { return k.prefix + "schedule" }

// asynqKeys builds the keys the asynq target writes, as hibiken/asynq
// v0.26.0 names them (internal/base/base.go). asynq's names are fixed: no
// namespace applies. The {<queue>} hash tag keeps a queue's keys in one
// cluster slot, as asynq's own scripts need.
type asynqKeys struct{}

// queues is the set of queue names asynq's Inspector and UI list.
func (asynqKeys) queues() string { return "asynq:queues" }

func (asynqKeys) queuePrefix(queue string) string { return "asynq:{" + queue + "}:" }

// task is a task's hash: msg (the encoded TaskMessage), state, and more.
func (k asynqKeys) task(queue, id string) string { return k.queuePrefix(queue) + "t:" + id }

// pending is the list of a queue's pending task ids; servers pop from the
// right.
func (k asynqKeys) pending(queue string) string { return k.queuePrefix(queue) + "pending" }

// scheduled is the sorted set of a queue's scheduled task ids, scored by
// integer epoch seconds.
func (k asynqKeys) scheduled(queue string) string { return k.queuePrefix(queue) + "scheduled" }

// unique is a task's uniqueness lock: its queue, type and the MD5 of its
// payload (asynq's base.UniqueKey, for a non-nil payload).
func (k asynqKeys) unique(queue, typename string, payload []byte) string {
	sum := md5.Sum(payload)
	return k.queuePrefix(queue) + "unique:" + typename + ":" + hex.EncodeToString(sum[:])
}

// streamKeys builds the keys the streams target writes.
type streamKeys struct {
	prefix string // "" or "<namespace>:"
}

func newStreamKeys(namespace string) streamKeys {
	if namespace == "" {
		return streamKeys{}
	}
	return streamKeys{prefix: namespace + ":"}
}

// stream is the stream a queue's jobs are added to.
func (k streamKeys) stream(queue string) string { return k.prefix + "stream:" + queue }

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
