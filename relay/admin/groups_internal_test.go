package admin

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// groupsSQL reads no name words for the group of every queue, which spells
// no name: it asked for words up to the 65,536 bytes a name may hold
// (16,385 of them, each a scan of every advisory lock held in the
// database), since LEAST(NULL, 65536) is 65536. Beside a fleet of 200
// schemas, whose relays held 3,400 such locks, that took 13 s per schema,
// and `stagedrain status --schemas` never finished.
func TestGroupsSQLReadsNoWordsForEveryQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.DatabaseURL()
	schema := testenv.Schema(t)
	conn := testenv.Conn(t, url)
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	rdb, ns := testenv.Redis(t)
	r, err := relay.New(relay.Config{DatabaseURL: url, Redis: rdb, Schema: schema, RedisNamespace: ns})
	if err != nil {
		t.Fatal(err)
	}
	testenv.RunUntilCleanup(t, r.Run)
	testenv.WaitFor(t, 15*time.Second, "the relay's group of every queue in pg_locks", func() (bool, string) {
		rows, err := conn.Query(ctx, groupsSQL, schema)
		if err != nil {
			return false, err.Error()
		}
		defer rows.Close()
		var seen []string
		for rows.Next() {
			var key int64
			var every bool
			var words []int64
			if err := rows.Scan(&key, &every, &words); err != nil {
				return false, err.Error()
			}
			if every {
				if len(words) != 0 {
					t.Fatalf("the group of every queue reads %d name words, want none", len(words))
				}
				return true, ""
			}
			seen = append(seen, fmt.Sprintf("key %d: %d words", key, len(words)))
		}
		return false, fmt.Sprintf("groups %v (err %v)", seen, rows.Err())
	})
}
