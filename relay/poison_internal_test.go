package relay

import (
	"context"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The poison rules are one set: for every payload, admin.ReadStatus's SQL
// (pgschema.StagedPushPoison) counts a row as poison exactly when the relay's
// mapping (mapStagedPush) finds no worker could run it.
func TestStagedPushPoisonRulesAgree(t *testing.T) {
	t.Parallel()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	payloads := []*string{nil}
	for _, p := range []string{
		`{"class":"A","args":[1]}`,
		`{"class":"A","args":[],"queue":"critical","jid":"abc","at":1.5,"created_at":1700000000,"retry":true}`,
		`{"class":"A","args":[],"created_at":1700000000123,"enqueued_at":"whatever"}`,
		`[1]`, `"s"`, `1`, `null`, `{}`,
		`{"args":[]}`, `{"class":"","args":[]}`, `{"class":1,"args":[]}`, `{"class":null,"args":[]}`,
		`{"class":"A"}`, `{"class":"A","args":{}}`, `{"class":"A","args":null}`, `{"class":"A","args":"[]"}`,
		`{"class":"A","args":[],"queue":""}`, `{"class":"A","args":[],"queue":null}`, `{"class":"A","args":[],"queue":5}`,
		`{"class":"A","args":[],"jid":""}`, `{"class":"A","args":[],"jid":7}`, `{"class":"A","args":[],"jid":null}`,
		`{"class":"A","args":[],"at":null}`, `{"class":"A","args":[],"at":"1.5"}`, `{"class":"A","args":[],"at":-1}`,
		`{"class":"A","args":[],"created_at":null}`, `{"class":"A","args":[],"created_at":"now"}`,
	} {
		payloads = append(payloads, &p)
	}
	for _, p := range payloads {
		var j stagedJob
		var raw []byte
		if p != nil {
			raw = []byte(*p)
		}
		mapStagedPush(&j, raw, nil, time.Now())
		var poison bool
		if err := conn.QueryRow(context.Background(), `SELECT `+stagedPushPoison+` FROM (SELECT $1::json AS j) t`, p).Scan(&poison); err != nil {
			t.Fatalf("payload %v: %v", p, err)
		}
		if poison != (j.bad != "") {
			shown := "NULL"
			if p != nil {
				shown = *p
			}
			t.Errorf("payload %s: SQL says poison %v, the mapping says %q", shown, poison, j.bad)
		}
	}
}
