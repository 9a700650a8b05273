package target

import (
	"bytes"
	"crypto/md5"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// asynqLength is what the asynq target's length guards measure: a queue's
// pending list.
const asynqLength = "LLEN"

// asynq: a task hash, LPUSH pending or ZADD scheduled.
func init() {
	Register(Spec{
		Name:        "asynq",
		Order:       2,
		Help:        "asynq",
		FixedKeys:   "must be empty with the asynq target: asynq's key names are fixed, and its servers would never see namespaced tasks",
		Length:      asynqLength,
		TraceSystem: "asynq",
		// The options the target maps (a tenant key among them would be
		// read as both), and the headers it writes.
		OwnedKeys: []string{"retry", "timeout", "deadline", "retention", "unique", "headers", TraceparentKey, TracestateKey},
		Goldens:   []string{"asynq_task.json", "asynq_task_scheduled_unique.json", "asynq_task_tenant.json"},
		New:       func(o Options) Builder { return newAsynqTarget(o) },
	})
}

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

// asynqTarget writes each job as a hibiken/asynq (v0.26.0) task, as asynq's
// own client would enqueue it: its type is job_name, its payload the
// job_args JSON text, its id the jid, its queue the queue. An immediate job
// is what asynq's enqueue script does (HSET asynq:{q}:t:<id> msg, state
// pending, pending_since; LPUSH asynq:{q}:pending <id>); a job whose run_at
// is in the future is what its schedule script does (HSET ... state
// scheduled; ZADD asynq:{q}:scheduled <epoch seconds> <id>). A batch's
// queues are added to asynq:queues, as asynq's client does before each
// enqueue.
//
// Each job is an op of its own, guarded by its task key, as asynq's scripts
// check EXISTS on it: a redelivery while the task still exists is skipped,
// not a second task. A job with the unique option is guarded by its
// uniqueness lock too: while the lock is held, the job is a duplicate and is
// dropped, as asynq's client refuses it (ErrDuplicateTask).
//
// An asynqTarget is used by one goroutine at a time: it reuses its buffers.
type asynqTarget struct {
	keys       asynqKeys
	maxPayload int    // bytes of the encoded message; a bigger one is rejected
	tenant     Tenant // a header of every task (relay/tenant.go); zero: none

	buf    []byte  // every encoded message of the batch, back to back
	ids    []int64 // the batch's ids, one op's slice each
	names  []any   // the batch's queue names, for SADD asynq:queues
	queues map[string]bool
}

func newAsynqTarget(o Options) *asynqTarget {
	return &asynqTarget{maxPayload: o.MaxPayload, tenant: o.Tenant, queues: make(map[string]bool)}
}

// asynq's defaults (client.go): 25 retries, and a 30 minute timeout when
// neither a timeout nor a deadline is given.
const (
	asynqDefaultRetry   = 25
	asynqDefaultTimeout = 30 * 60 // seconds
)

// taskMessage is the part of asynq's TaskMessage (internal/proto/asynq.proto)
// that a new task sets.
type taskMessage struct {
	typename  string
	payload   []byte
	headers   map[string]string
	id        string
	queue     string
	retry     int64
	timeout   int64 // seconds; 0 none
	deadline  int64 // epoch seconds; 0 none
	uniqueKey string
	retention int64 // seconds
}

// asynqTask is a job as an asynq task: its message and how it is enqueued.
type asynqTask struct {
	msg    taskMessage
	unique int64 // uniqueness lock TTL in seconds; 0 none
}

func (a *asynqTarget) Add(u *handoff.Unit, batch []Job, now time.Time, res *Result) {
	a.buf, a.ids, a.names = a.buf[:0], a.ids[:0], a.names[:0]
	clear(a.queues)
	a.ids = slices.Grow(a.ids, len(batch)) // never moves: each op keeps a slice of it
	for i := range batch {
		j := &batch[i]
		t, err := newAsynqTask(j, a.tenant)
		if err != nil {
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: err.Error()})
			continue
		}
		start := len(a.buf)
		a.buf = appendTaskMessage(a.buf, &t.msg)
		if n := len(a.buf) - start; n > a.maxPayload {
			a.buf = a.buf[:start]
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: fmt.Sprintf("task message is %d bytes, over the limit of %d (MaxPayloadBytes)", n, a.maxPayload)})
			continue
		}
		// Appending may move buf, but never rewrites bytes already
		// written: this slice stays valid until the next batch.
		msg := a.buf[start:len(a.buf):len(a.buf)]
		a.ids = append(a.ids, j.ID)
		if !a.queues[j.Queue] {
			a.queues[j.Queue] = true
			a.names = append(a.names, j.Queue)
		}
		scheduled := j.scheduled(now)
		if scheduled {
			res.Scheduled++
		} else if !slices.Contains(res.Queues, j.Queue) {
			res.Queues = append(res.Queues, j.Queue)
		}
		a.op(u, a.ids[len(a.ids)-1:len(a.ids):len(a.ids)], &t, msg, j, scheduled, now)
	}
	if len(a.names) > 0 {
		// Bookkeeping: asynq's servers take tasks from the queues they are
		// configured with; asynq:queues feeds its Inspector and UI. (The
		// script is atomic: that asynq's client adds it first is moot.)
		u.Begin(nil)
		u.Variadic("SADD", a.keys.queues(), 1, a.names)
	}
}

// op adds the commands that enqueue one task, as asynq's enqueue, schedule
// and their unique variants do.
func (a *asynqTarget) op(u *handoff.Unit, ids []int64, t *asynqTask, msg []byte, j *Job, scheduled bool, now time.Time) {
	m := &t.msg
	task := a.keys.task(m.queue, m.id)
	u.Begin(ids, task, m.uniqueKey)
	if !scheduled {
		u.Limit(m.queue, asynqLength, a.keys.pending(m.queue))
	}
	if m.uniqueKey != "" {
		// The guard skipped the op if the lock is held: this SET is
		// asynq's SET NX EX. A scheduled task's lock lasts until its
		// run_at plus the TTL, as asynq's client.schedule computes it.
		ttl := t.unique
		if scheduled {
			ttl = int64(j.RunAt.Add(time.Duration(t.unique) * time.Second).Sub(now).Seconds())
		}
		u.Command("SET", m.uniqueKey, m.id, "EX", ttl)
	}
	if scheduled {
		if m.uniqueKey != "" {
			u.Command("HSET", task, "msg", msg, "state", "scheduled", "unique_key", m.uniqueKey)
		} else {
			u.Command("HSET", task, "msg", msg, "state", "scheduled")
		}
		u.Command("ZADD", a.keys.scheduled(m.queue), j.RunAt.Unix(), m.id)
		return
	}
	if m.uniqueKey != "" {
		u.Command("HSET", task, "msg", msg, "state", "pending", "pending_since", now.UnixNano(), "unique_key", m.uniqueKey)
	} else {
		u.Command("HSET", task, "msg", msg, "state", "pending", "pending_since", now.UnixNano())
	}
	u.Command("LPUSH", a.keys.pending(m.queue), m.id)
}

// newAsynqTask maps a row onto an asynq task, with tenant's header when it
// is on, or says why no asynq server could run it.
func newAsynqTask(j *Job, tenant Tenant) (asynqTask, error) {
	args, err := check(j)
	if err != nil {
		return asynqTask{}, err
	}
	// asynq refuses blank names (ValidateQueueName, Client.Enqueue).
	switch {
	case strings.TrimSpace(j.Name) == "":
		return asynqTask{}, errors.New("job_name is blank: asynq refuses a blank task type")
	case strings.TrimSpace(j.Queue) == "":
		return asynqTask{}, errors.New("queue is blank: asynq refuses a blank queue name")
	case strings.TrimSpace(j.JID) == "":
		return asynqTask{}, errors.New("jid is blank: asynq refuses a blank task id")
	}
	t := asynqTask{msg: taskMessage{typename: j.Name, payload: args, id: j.JID, queue: j.Queue, retry: asynqDefaultRetry}}
	if err := t.setOptions(j.Options, tenant); err != nil {
		return asynqTask{}, err
	}
	if tenant.on() {
		if t.msg.headers == nil {
			t.msg.headers = make(map[string]string, 1)
		}
		t.msg.headers[tenant.key] = tenant.schema
	}
	if t.msg.timeout == 0 && t.msg.deadline == 0 {
		t.msg.timeout = asynqDefaultTimeout
	}
	if t.unique > 0 {
		t.msg.uniqueKey = asynqKeys{}.unique(t.msg.queue, t.msg.typename, t.msg.payload)
	}
	return t, nil
}

// setOptions maps a row's options onto asynq's task options:
//
//	retry      MaxRetry: an integer (below 0 means 0), or false (0) / true (25)
//	timeout    Timeout, integer seconds (0: none; with no deadline, asynq's 30m)
//	deadline   Deadline, integer epoch seconds or RFC 3339 text
//	retention  Retention, integer seconds
//	unique     Unique, the lock's TTL in integer seconds (at least 1)
//	headers    the task's headers, an object of strings
//	traceparent, tracestate  the trace context, into the headers (relay/trace.go)
//	<tenant key>  the tenant, which must be the schema's (relay/tenant.go)
//
// Any other key is an error: asynq has no option for it.
func (t *asynqTask) setOptions(raw []byte, tenant Tenant) error {
	opts, err := decodeOptions(raw)
	if err != nil {
		return err
	}
	if err := tenant.check(opts); err != nil {
		return err
	}
	if len(opts) == 0 {
		return nil
	}
	keys := make([]string, 0, len(opts))
	for k := range opts {
		keys = append(keys, k)
	}
	slices.Sort(keys) // the first bad key reported is the same every time
	for _, k := range keys {
		v := bytes.TrimSpace(opts[k])
		if tenant.on() && k == tenant.key {
			continue // checked above; newAsynqTask writes the header
		}
		switch k {
		case TraceparentKey, TracestateKey: // below
		case "retry":
			var b bool
			if json.Unmarshal(v, &b) == nil {
				t.msg.retry = 0
				if b {
					t.msg.retry = asynqDefaultRetry
				}
				continue
			}
			n, err := optionInt(k, v, math.MinInt64)
			if err != nil {
				return err
			}
			t.msg.retry = min(max(n, 0), math.MaxInt32)
		case "timeout":
			if t.msg.timeout, err = optionInt(k, v, 0); err != nil {
				return err
			}
		case "retention":
			if t.msg.retention, err = optionInt(k, v, 0); err != nil {
				return err
			}
		case "unique":
			if t.unique, err = optionInt(k, v, 1); err != nil {
				return err
			}
		case "deadline":
			var s string
			if json.Unmarshal(v, &s) == nil {
				d, err := time.Parse(time.RFC3339Nano, s)
				if err != nil {
					return fmt.Errorf("options %q must be integer epoch seconds or RFC 3339 text, got %s", k, v)
				}
				t.msg.deadline = d.Unix()
				continue
			}
			if t.msg.deadline, err = optionInt(k, v, 0); err != nil {
				return fmt.Errorf("options %q must be integer epoch seconds or RFC 3339 text, got %s", k, v)
			}
		case "headers":
			if err := json.Unmarshal(v, &t.msg.headers); err != nil || bytes.Equal(v, []byte("null")) {
				return fmt.Errorf("options %q must be an object of strings, got %s", k, v)
			}
			if name, ok := t.msg.headers[tenant.key]; ok && tenant.on() {
				if err := tenant.checkName(name, "the job's headers name"); err != nil {
					return err
				}
			}
		default:
			return fmt.Errorf("options sets %q, which asynq has no task option for (the asynq target maps retry, timeout, deadline, retention, unique, headers, traceparent and tracestate)", k)
		}
	}
	// The trace context goes into the headers (relay/trace.go); a malformed
	// traceparent is dropped.
	if tp, ts, _ := TraceOptions(opts); tp != "" {
		if t.msg.headers == nil {
			t.msg.headers = make(map[string]string, 2)
		}
		t.msg.headers[TraceparentKey] = tp
		if ts != "" {
			t.msg.headers[TracestateKey] = ts
		} else {
			delete(t.msg.headers, TracestateKey)
		}
	}
	return nil
}

// appendTaskMessage appends m in protobuf's wire format, as asynq's
// base.EncodeMessage (proto.Marshal of its generated TaskMessage) writes
// it: fields in number order, zero values left out, headers (a map) as
// entries of key 1 and value 2, here in key order.
func appendTaskMessage(b []byte, m *taskMessage) []byte {
	str := func(b []byte, num protowire.Number, s string) []byte {
		if s == "" {
			return b
		}
		b = protowire.AppendTag(b, num, protowire.BytesType)
		return protowire.AppendString(b, s)
	}
	varint := func(b []byte, num protowire.Number, v int64) []byte {
		if v == 0 {
			return b
		}
		b = protowire.AppendTag(b, num, protowire.VarintType)
		return protowire.AppendVarint(b, uint64(v))
	}
	b = str(b, 1, m.typename) // type
	if len(m.payload) > 0 {   // payload
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, m.payload)
	}
	b = str(b, 3, m.id)          // id
	b = str(b, 4, m.queue)       // queue
	b = varint(b, 5, m.retry)    // retry (int32)
	b = varint(b, 8, m.timeout)  // timeout
	b = varint(b, 9, m.deadline) // deadline
	b = str(b, 10, m.uniqueKey)  // unique_key
	b = varint(b, 12, m.retention)
	if len(m.headers) > 0 { // headers = 15
		keys := make([]string, 0, len(m.headers))
		for k := range m.headers {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			v := m.headers[k]
			n := protowire.SizeTag(1) + protowire.SizeBytes(len(k)) + protowire.SizeTag(2) + protowire.SizeBytes(len(v))
			b = protowire.AppendTag(b, 15, protowire.BytesType)
			b = protowire.AppendVarint(b, uint64(n))
			b = protowire.AppendTag(b, 1, protowire.BytesType)
			b = protowire.AppendString(b, k)
			b = protowire.AppendTag(b, 2, protowire.BytesType)
			b = protowire.AppendString(b, v)
		}
	}
	return b
}
