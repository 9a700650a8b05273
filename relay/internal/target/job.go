package target

import (
	"bytes"
	"errors"
	"time"
)

// check reports a row no worker could run: an empty job_name or queue, or
// job_args that is not a JSON array (possible only where the table's
// constraints were removed; the relay refuses those rows before a Builder
// sees them, and checks what only it knows, NULL columns). It returns the
// job_args JSON text, trimmed.
func check(j *Job) ([]byte, error) {
	switch {
	case j.Name == "":
		return nil, errors.New("job_name is empty")
	case j.Queue == "":
		return nil, errors.New("queue is empty")
	}
	args := bytes.TrimSpace(j.Args)
	if len(args) == 0 || args[0] != '[' {
		return nil, errors.New("job_args is not a JSON array")
	}
	return args, nil
}

// scheduled reports whether j runs after now: a target with a schedule
// writes it there.
func (j *Job) scheduled(now time.Time) bool {
	return j.RunAt != nil && j.RunAt.After(now)
}

// queueGroup is the jobs of a batch that go to one list, in one op.
type queueGroup struct {
	name     string
	ids      []int64
	payloads []any
}

// reject adds j to res as a row no worker could run.
func (res *Result) reject(j *Job, err error) {
	res.Rejected = append(res.Rejected, Rejected{ID: j.ID, Reason: err.Error()})
}
