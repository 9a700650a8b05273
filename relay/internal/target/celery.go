package target

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// celeryLength is what the celery target's length guards measure: a
// queue's lists, one per priority step, summed as Kombu's _size does.
const celeryLength = "LLEN"

// Celery (task protocol 2, Kombu's Redis transport): LPUSH of a message
// envelope. Celery on Redis holds an eta in memory: jobs are claimed once
// due.
func init() {
	Register(Spec{
		Name:        "celery",
		Order:       5,
		Help:        "celery (Celery task protocol 2)",
		DueOnly:     true,
		NoCluster:   "Kombu's Redis transport, which Celery's workers read with, does not support Redis Cluster (use a single Redis or Sentinel)",
		Length:      celeryLength,
		TraceSystem: "celery",
		// The protocol's headers and the options the target maps.
		OwnedKeys: append(slices.Clone(celeryProtocolHeaders), celeryOptions...),
		Goldens:   []string{"celery_task.json", "celery_task_namespace_tenant.json"},
		New:       func(o Options) Builder { return newCeleryTarget(o) },
	})
}

// celeryTarget writes each job as a Celery task message, as Celery's own
// apply_async would send it over Kombu's Redis transport, for Celery 5.2
// (Debian's python3-celery 5.2.6 with python3-kombu 5.2.4, the versions the
// real-worker test runs):
//
//	LPUSH [<namespace>:]<queue>[\x06\x16<3|6|9>] <message JSON>
//
// The message is the task protocol version 2 (Celery's "Message Protocol"
// document, docs/internals/protocol.rst; celery/app/amqp.py as_task_v2) in
// Kombu's JSON envelope for virtual transports (kombu/transport/virtual/
// base.py Channel.prepare_message and _inplace_augment_message):
//
//	{"body": base64 of [args, kwargs, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}],
//	 "content-encoding": "utf-8", "content-type": "application/json",
//	 "headers": {"lang": "py", "task": <job_name>, "id": <jid>, "shadow": null, "eta": null,
//	             "expires": null, "group": null, "group_index": null, "retries": 0,
//	             "timelimit": [null, null], "root_id": <jid>, "parent_id": null,
//	             "argsrepr": ..., "kwargsrepr": ..., "origin": "stagedrain", "ignore_result": false},
//	 "properties": {"correlation_id": <jid>, "reply_to": "", "delivery_mode": 2,
//	                "delivery_info": {"exchange": "", "routing_key": <queue>},
//	                "priority": 0, "body_encoding": "base64", "delivery_tag": <random UUID>}}
//
// The list is the queue's name, as Kombu's Channel._put LPUSHes it
// (kombu/transport/redis.py): with a priority, the list of its step in
// Kombu's default priority_steps [0, 3, 6, 9] (_q_for_pri: 0-2 the queue's
// own list, 3-5 "<queue>\x06\x163", 6-8 "...6", 9 "...9"). The worker
// BRPOPs the queue's lists in that order (_brpop_start), so on Redis a
// lower number runs first, and LPUSH then BRPOP keeps each list FIFO.
// Each list is an op, so a WRONGTYPE on one refuses only its jobs.
//
// A job's id is its jid as it is: Celery takes any string (a 24-hex jid
// runs; an app may stage a UUID, as Celery's own ids are). The
// delivery_tag, Kombu's key of the message in its unacked hash while a
// worker holds it, is a random UUID per message, as Kombu's
// _next_delivery_tag makes.
//
// Scheduled jobs: with Redis, a Celery worker keeps a task with an eta in
// its memory until due, and Kombu redelivers it after the visibility
// timeout (1 hour) if it is not acknowledged by then: a job days away
// would be redelivered to worker after worker. So this target is due-only,
// as the streams one: the relay claims a row only once its run_at is due
// (tableSQL.claimDue) and wakes for the next one (Relay.nextDue). The eta
// header is always null.
//
// --redis-namespace: Kombu's Redis transport prefixes every key it uses
// with the transport option global_keyprefix (PrefixedStrictRedis). A
// namespace ns puts the lists under "ns:"; the workers must then set
// broker_transport_options = {"global_keyprefix": "ns:"}.
//
// Redis Cluster is refused (Config.Validate): Kombu's Redis transport is
// not cluster-aware (one BRPOP over a queue's lists, MULTI/EXEC in its
// unacked bookkeeping), so no Celery worker could read such a cluster.
//
// A celeryTarget is used by one goroutine at a time: it reuses its buffers.
type celeryTarget struct {
	keys       celeryKeys
	maxPayload int    // bytes of a message; a bigger one is rejected
	tenant     Tenant // a header of every message (relay/tenant.go); zero: none
	// tags returns n delivery tags; random UUIDs, fixed in golden tests.
	tags func(n int) []string

	buf    []byte         // every message of the batch, back to back
	lists  []queueGroup   // jobs by list, in order of first use (name: the list key)
	listAt map[string]int // list key -> index in lists
	queue  []string       // lists[i]'s queue
}

func newCeleryTarget(o Options) *celeryTarget {
	tags := o.UUIDs
	if tags == nil {
		tags = randomUUIDs
	}
	return &celeryTarget{keys: newCeleryKeys(o.Namespace), maxPayload: o.MaxPayload, tenant: o.Tenant, tags: tags, listAt: make(map[string]int)}
}

// celeryKeys builds the lists the celery target writes: Kombu's Redis
// transport's names for a queue.
type celeryKeys struct {
	prefix string // "" or "<namespace>:" (Kombu's global_keyprefix)
}

func newCeleryKeys(namespace string) celeryKeys {
	if namespace == "" {
		return celeryKeys{}
	}
	return celeryKeys{prefix: namespace + ":"}
}

// celeryPrioritySteps is Kombu's PRIORITY_STEPS (kombu/transport/redis.py),
// the default of its priority_steps transport option.
var celeryPrioritySteps = [...]int{0, 3, 6, 9}

// celeryPrioritySep is Kombu's Channel.sep, between a queue and its step.
const celeryPrioritySep = "\x06\x16"

// list is the list a job of priority (0-9) in queue is LPUSHed to.
func (k celeryKeys) list(queue string, priority int) string {
	step := 0
	for _, s := range celeryPrioritySteps {
		if priority >= s {
			step = s
		}
	}
	if step == 0 {
		return k.prefix + queue
	}
	return k.prefix + queue + celeryPrioritySep + strconv.Itoa(step)
}

// lists are every list of queue, as Kombu's _size counts them.
func (k celeryKeys) lists(queue string) []string {
	out := make([]string, len(celeryPrioritySteps))
	for i, s := range celeryPrioritySteps {
		out[i] = k.list(queue, s)
	}
	return out
}

func (c *celeryTarget) Add(u *handoff.Unit, batch []Job, now time.Time, res *Result) {
	c.buf, c.lists, c.queue = c.buf[:0], c.lists[:0], c.queue[:0]
	clear(c.listAt)
	tags := c.tags(len(batch))
	for i := range batch {
		j := &batch[i]
		m, err := newCeleryMessage(j, c.tenant)
		if err != nil {
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: err.Error()})
			continue
		}
		start := len(c.buf)
		c.buf = m.appendJSON(c.buf, j, tags[i])
		if n := len(c.buf) - start; n > c.maxPayload {
			c.buf = c.buf[:start]
			res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: fmt.Sprintf("task message is %d bytes, over the limit of %d (MaxPayloadBytes)", n, c.maxPayload)})
			continue
		}
		// Appending may move buf, but never rewrites bytes already
		// written: this slice stays valid until the next batch.
		msg := c.buf[start:len(c.buf):len(c.buf)]
		g := c.group(j.Queue, c.keys.list(j.Queue, m.priority))
		g.ids = append(g.ids, j.ID)
		g.payloads = append(g.payloads, msg)
	}
	for i := range c.lists {
		g := &c.lists[i]
		u.Begin(g.ids)
		// Backpressure counts the queue's jobs in all its lists, as
		// Kombu's _size does.
		u.Limit(c.queue[i], celeryLength, c.keys.lists(c.queue[i])...)
		u.Variadic("LPUSH", g.name, 1, g.payloads)
		if !slices.Contains(res.Queues, c.queue[i]) {
			res.Queues = append(res.Queues, c.queue[i])
		}
	}
}

// group returns the group of the list key, of queue, adding it on first use.
func (c *celeryTarget) group(queue, key string) *queueGroup {
	i, ok := c.listAt[key]
	if !ok {
		i = len(c.lists)
		c.listAt[key] = i
		if i < cap(c.lists) {
			c.lists = c.lists[:i+1] // reuse the slices of an earlier batch
			g := &c.lists[i]
			g.name, g.ids, g.payloads = key, g.ids[:0], g.payloads[:0]
		} else {
			c.lists = append(c.lists, queueGroup{name: key})
		}
		c.queue = append(c.queue, queue)
	}
	return &c.lists[i]
}

// celeryMessage is what a row's options set in a Celery task message.
type celeryMessage struct {
	args, kwargs []byte // JSON texts; kwargs "{}" when not staged
	priority     int
	expires      string // ISO 8601; "" none
	retries      int64
	hard, soft   []byte // timelimit's JSON numbers; nil none
	shadow       string
	ignoreResult bool
	headers      []celeryHeader // custom headers, the tenant and the trace context, in this order
}

type celeryHeader struct {
	key   string
	value []byte // JSON text
}

// celeryProtocolHeaders are the headers of task protocol 2 that the
// message always has: a custom header may not be one of them.
var celeryProtocolHeaders = []string{"lang", "task", "id", "shadow", "eta", "expires", "group", "group_index",
	"retries", "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result"}

// celeryOptions are the options the target maps (newCeleryMessage).
var celeryOptions = []string{"kwargs", "priority", "expires", "retries", "time_limit", "soft_time_limit",
	"shadow", "ignore_result", "headers", TraceparentKey, TracestateKey}

// newCeleryMessage maps a row onto a task message, or says why no Celery
// worker could run it. The options it maps:
//
//	kwargs           the task's keyword arguments: a JSON object
//	priority         0 to 9 (Kombu's range; on Redis 0 runs first): the list and properties.priority
//	expires          seconds after created_at (a number), or an ISO 8601 / RFC 3339 time: headers.expires
//	retries          how many times the task was retried already, an integer of at least 0
//	time_limit, soft_time_limit  seconds, a number above 0: headers.timelimit [hard, soft]
//	shadow           the name the worker logs the task under, a string
//	ignore_result    a boolean
//	headers          custom headers, an object (not the protocol's own names): task.request.<key>
//	traceparent, tracestate  the trace context, as headers (relay/trace.go)
//	<tenant key>     the tenant, which must be the schema's (relay/tenant.go), as a header
//
// Any other key is an error; eta and countdown say to use run_at.
func newCeleryMessage(j *Job, tenant Tenant) (celeryMessage, error) {
	args, err := check(j)
	if err != nil {
		return celeryMessage{}, err
	}
	m := celeryMessage{args: args, kwargs: []byte("{}")}
	opts, err := decodeOptions(j.Options)
	if err != nil {
		return m, err
	}
	if err := tenant.check(opts); err != nil {
		return m, err
	}
	keys := make([]string, 0, len(opts))
	for k := range opts {
		keys = append(keys, k)
	}
	slices.Sort(keys) // the first bad key reported is the same every time
	for _, k := range keys {
		v := bytes.TrimSpace(opts[k])
		if tenant.on() && k == tenant.key {
			continue // checked above; written below
		}
		switch k {
		case TraceparentKey, TracestateKey: // below
		case "kwargs":
			if len(v) == 0 || v[0] != '{' {
				return m, fmt.Errorf("options %q must be a JSON object (the task's keyword arguments), got %s", k, Truncate(string(v), 80))
			}
			m.kwargs = v
		case "priority":
			n, err := optionInt(k, v, 0)
			if err != nil || n > 9 {
				return m, fmt.Errorf("options %q must be an integer from 0 to 9 (Kombu's Redis priorities; 0 runs first), got %s", k, Truncate(string(v), 80))
			}
			m.priority = int(n)
		case "expires":
			var s string
			var secs float64
			switch {
			case json.Unmarshal(v, &s) == nil:
				t, err := time.Parse(time.RFC3339Nano, s)
				if err != nil {
					return m, fmt.Errorf("options %q must be seconds after created_at or an ISO 8601 time with its offset, got %s", k, Truncate(string(v), 80))
				}
				m.expires = pythonISO(t)
			case json.Unmarshal(v, &secs) == nil && secs >= 0 && secs < 1e11:
				m.expires = pythonISO(j.CreatedAt.Add(time.Duration(secs * float64(time.Second))))
			default:
				return m, fmt.Errorf("options %q must be seconds after created_at or an ISO 8601 time with its offset, got %s", k, Truncate(string(v), 80))
			}
		case "retries":
			if m.retries, err = optionInt(k, v, 0); err != nil {
				return m, err
			}
		case "time_limit", "soft_time_limit":
			var f float64
			if json.Unmarshal(v, &f) != nil || !(f > 0) || math.IsInf(f, 0) {
				return m, fmt.Errorf("options %q must be a number of seconds above 0, got %s", k, Truncate(string(v), 80))
			}
			if k == "time_limit" {
				m.hard = v
			} else {
				m.soft = v
			}
		case "shadow":
			if json.Unmarshal(v, &m.shadow) != nil {
				return m, fmt.Errorf("options %q must be a string, got %s", k, Truncate(string(v), 80))
			}
		case "ignore_result":
			if json.Unmarshal(v, &m.ignoreResult) != nil || bytes.Equal(v, []byte("null")) {
				return m, fmt.Errorf("options %q must be true or false, got %s", k, Truncate(string(v), 80))
			}
		case "headers":
			var hs map[string]json.RawMessage
			if json.Unmarshal(v, &hs) != nil || hs == nil {
				return m, fmt.Errorf("options %q must be a JSON object of custom headers, got %s", k, Truncate(string(v), 80))
			}
			names := make([]string, 0, len(hs))
			for name := range hs {
				names = append(names, name)
			}
			slices.Sort(names)
			for _, name := range names {
				switch {
				case slices.Contains(celeryProtocolHeaders, name):
					return m, fmt.Errorf("options \"headers\" sets %q, a header of Celery's task protocol that the relay writes", name)
				case name == TraceparentKey || name == TracestateKey:
					return m, fmt.Errorf("options \"headers\" sets %q: stage the trace context as the option %q", name, name)
				case tenant.on() && name == tenant.key:
					var s string
					if json.Unmarshal(hs[name], &s) != nil {
						return m, fmt.Errorf("tenant mismatch: the job's headers set %q to %s, not to the name of the schema it was staged in, %q", name, Truncate(string(hs[name]), 80), tenant.schema)
					}
					if err := tenant.checkName(s, "the job's headers name"); err != nil {
						return m, err
					}
					continue // written once, below
				}
				m.headers = append(m.headers, celeryHeader{name, bytes.TrimSpace(hs[name])})
			}
		case "eta", "countdown":
			return m, fmt.Errorf("options sets %q: stage the time in run_at (the relay holds the job until then; a Celery worker on Redis would hold it in memory)", k)
		default:
			return m, fmt.Errorf("options sets %q, which the celery target has no mapping for (it maps %s)", k, strings.Join(celeryOptions, ", "))
		}
	}
	if tenant.on() {
		m.headers = append(m.headers, celeryHeader{tenant.key, AppendJSONString(nil, tenant.schema)})
	}
	// The trace context, as headers: opentelemetry-instrumentation-celery
	// injects it into the message's headers (before_task_publish) and
	// extracts it from task.request's attributes, which the worker sets
	// from them (relay/trace.go). A malformed traceparent is dropped.
	if tp, ts, _ := TraceOptions(opts); tp != "" {
		m.headers = append(m.headers, celeryHeader{TraceparentKey, AppendJSONString(nil, tp)})
		if ts != "" {
			m.headers = append(m.headers, celeryHeader{TracestateKey, AppendJSONString(nil, ts)})
		}
	}
	return m, nil
}

// celeryReprMax is Celery's argsrepr_maxsize and kwargsrepr_maxsize.
const celeryReprMax = 1024

// appendJSON appends the message, in Kombu's envelope, to b.
func (m *celeryMessage) appendJSON(b []byte, j *Job, tag string) []byte {
	null := func(b []byte, s string) []byte {
		if s == "" {
			return append(b, "null"...)
		}
		return AppendJSONString(b, s)
	}
	num := func(b, v []byte) []byte {
		if v == nil {
			return append(b, "null"...)
		}
		return append(b, v...)
	}
	b = append(b, `{"body":"`...)
	body := make([]byte, 0, len(m.args)+len(m.kwargs)+70)
	body = append(append(body, '['), m.args...)
	body = append(append(body, ','), m.kwargs...)
	body = append(body, `,{"callbacks":null,"errbacks":null,"chain":null,"chord":null}]`...)
	b = base64.StdEncoding.AppendEncode(b, body)
	b = append(b, `","content-encoding":"utf-8","content-type":"application/json","headers":{"lang":"py","task":`...)
	b = AppendJSONString(b, j.Name)
	b = append(b, `,"id":`...)
	b = AppendJSONString(b, j.JID)
	b = append(b, `,"shadow":`...)
	b = null(b, m.shadow)
	b = append(b, `,"eta":null,"expires":`...)
	b = null(b, m.expires)
	b = append(b, `,"group":null,"group_index":null,"retries":`...)
	b = strconv.AppendInt(b, m.retries, 10)
	b = append(b, `,"timelimit":[`...)
	b = num(b, m.hard)
	b = append(b, ',')
	b = num(b, m.soft)
	b = append(b, `],"root_id":`...)
	b = AppendJSONString(b, j.JID)
	b = append(b, `,"parent_id":null,"argsrepr":`...)
	b = AppendJSONString(b, reprOf(m.args))
	b = append(b, `,"kwargsrepr":`...)
	b = AppendJSONString(b, reprOf(m.kwargs))
	b = append(b, `,"origin":"stagedrain","ignore_result":`...)
	b = strconv.AppendBool(b, m.ignoreResult)
	for _, h := range m.headers {
		b = append(b, ',')
		b = AppendJSONString(b, h.key)
		b = append(b, ':')
		b = append(b, h.value...)
	}
	b = append(b, `},"properties":{"correlation_id":`...)
	b = AppendJSONString(b, j.JID)
	b = append(b, `,"reply_to":"","delivery_mode":2,"delivery_info":{"exchange":"","routing_key":`...)
	b = AppendJSONString(b, j.Queue)
	b = append(b, `},"priority":`...)
	b = strconv.AppendInt(b, int64(m.priority), 10)
	b = append(b, `,"body_encoding":"base64","delivery_tag":`...)
	b = AppendJSONString(b, tag)
	return append(b, "}}"...)
}

// reprOf is the argsrepr or kwargsrepr of a JSON text: Celery writes
// Python's repr there, for logs and monitors only; the relay writes the
// JSON text, cut at celeryReprMax bytes as Celery's saferepr cuts it.
func reprOf(v []byte) string {
	if len(v) <= celeryReprMax {
		return string(v)
	}
	n := celeryReprMax
	for n > 0 && !utf8.RuneStart(v[n]) {
		n--
	}
	return string(v[:n]) + "..."
}

// pythonISO formats t as Python's datetime.isoformat of an aware UTC time
// writes it, which Celery's parse_iso8601 reads.
func pythonISO(t time.Time) string {
	t = t.UTC().Truncate(time.Microsecond)
	if t.Nanosecond() == 0 {
		return t.Format("2006-01-02T15:04:05-07:00")
	}
	return t.Format("2006-01-02T15:04:05.000000-07:00")
}

// randomUUIDs returns n random (version 4) UUIDs.
func randomUUIDs(n int) []string {
	raw := make([]byte, 16*n)
	_, _ = rand.Read(raw)
	out := make([]string, n)
	var s [36]byte
	for i := range out {
		u := raw[16*i : 16*i+16]
		u[6] = u[6]&0x0f | 0x40
		u[8] = u[8]&0x3f | 0x80
		hex.Encode(s[0:8], u[0:4])
		s[8] = '-'
		hex.Encode(s[9:13], u[4:6])
		s[13] = '-'
		hex.Encode(s[14:18], u[6:8])
		s[18] = '-'
		hex.Encode(s[19:23], u[8:10])
		s[23] = '-'
		hex.Encode(s[24:36], u[10:16])
		out[i] = string(s[:])
	}
	return out
}
