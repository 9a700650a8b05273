package relay

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// A leader whose lock connection's ping fails after it has not pinged for
// longer than idle_session_timeout (it was paused) says that PostgreSQL
// ended the idle session, whatever error the ping got: woken from SIGSTOP
// on a busy machine, the ping's own deadline fired before it read
// PostgreSQL's 57P05, and the reason read "did not answer in time".
func TestStepDownReasonAfterAPause(t *testing.T) {
	idle := lockIdleTimeout(500 * time.Millisecond)
	deadline := context.DeadlineExceeded // what the ping's timeout wraps
	for _, c := range []struct {
		name  string
		err   error
		since time.Duration
		want  string
	}{
		{"a timeout after a pause", deadline, 10 * time.Second, "idle_session_timeout"},
		{"a deadline while pinging on time", deadline, 300 * time.Millisecond, "the lock connection failed"},
		{"57P05", &pgconn.PgError{Code: "57P05"}, 300 * time.Millisecond, "idle_session_timeout"},
		{"another failure after a pause", errors.New("conn closed"), 10 * time.Second, "idle_session_timeout"},
		{"another failure on time", errors.New("conn closed"), 300 * time.Millisecond, "the lock connection failed"},
	} {
		err := lostLock(c.err, c.since, idle)
		if !errors.Is(err, errLostLock) {
			t.Errorf("%s: %v is not errLostLock", c.name, err)
		}
		got := stepDownReason(err)
		if !strings.Contains(got, c.want) {
			t.Errorf("%s: reason %q, want it to say %q", c.name, got, c.want)
		}
		if paused := c.since > idle; paused != errors.Is(err, errIdledOut) {
			t.Errorf("%s: %v, errIdledOut %v, want %v after %v without a ping (idle_session_timeout %v)",
				c.name, err, !paused, paused, c.since, idle)
		}
	}
}
