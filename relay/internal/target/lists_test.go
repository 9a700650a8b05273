package target_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	"github.com/stagedrain/stagedrain/relay/internal/target"
)

// The lists target is the whole of a new target, used only in tests: this
// file, its golden file (testdata/lists.json) and nothing else. It RPUSHes
// each job, as a JSON object, to the list [<namespace>:]lists:<queue>; it
// has no schedule, so the relay claims jobs only once due.
func init() {
	target.Register(target.Spec{
		Name:        "lists",
		Order:       6,
		Help:        "lists (a test-only target)",
		DueOnly:     true,
		Length:      "LLEN",
		TraceSystem: "lists",
		Goldens:     []string{"relay/internal/target/testdata/lists.json"},
		New: func(o target.Options) target.Builder {
			prefix := ""
			if o.Namespace != "" {
				prefix = o.Namespace + ":"
			}
			return &lists{prefix: prefix + "lists:", maxPayload: o.MaxPayload}
		},
	})
}

type lists struct {
	prefix     string
	maxPayload int
}

// listJob is a job as the lists target writes it.
type listJob struct {
	JID       string          `json:"jid"`
	Class     string          `json:"class"`
	Args      json.RawMessage `json:"args"`
	Queue     string          `json:"queue"`
	CreatedAt int64           `json:"created_at"` // epoch ms
}

func (l *lists) Add(u *handoff.Unit, batch []target.Job, now time.Time, res *target.Result) {
	for _, j := range batch {
		payload, err := json.Marshal(listJob{JID: j.JID, Class: j.Name, Args: j.Args, Queue: j.Queue, CreatedAt: j.CreatedAt.UnixMilli()})
		if err == nil && len(payload) > l.maxPayload {
			err = fmt.Errorf("payload is %d bytes, over the limit of %d (MaxPayloadBytes)", len(payload), l.maxPayload)
		}
		if err != nil {
			res.Rejected = append(res.Rejected, target.Rejected{ID: j.ID, Reason: err.Error()})
			continue
		}
		key := l.prefix + j.Queue
		u.Begin([]int64{j.ID}) // an op per job: a WRONGTYPE refuses only it
		u.Limit(j.Queue, "LLEN", key)
		u.Command("RPUSH", key, payload)
		if !slices.Contains(res.Queues, j.Queue) {
			res.Queues = append(res.Queues, j.Queue)
		}
	}
}
