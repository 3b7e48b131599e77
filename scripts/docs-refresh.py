#!/usr/bin/env python3
"""Re-runs each `dprouter simulate` command of the `console` blocks of README.md and docs/*.md whose shown output
has no patterns (`...`, `[..]`, `? status`), and writes what it prints in their place (and any chart it draws).
For a deliberate change of the simulator or of a policy's defaults: the diff shows every figure that moved, and
the prose around each must be checked by hand. Uses target/release/dprouter (`cargo build --release` first)."""
import glob, os, subprocess

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
env = dict(os.environ, PATH=f"{root}/target/release:" + os.environ["PATH"], RUST_LOG="warn")
files = [f'{root}/README.md'] + sorted(glob.glob(f'{root}/docs/*.md'))
for f in files:
    lines = open(f).read().split('\n')
    out = []; i = 0; in_block = False; changed = 0
    while i < len(lines):
        l = lines[i]; t = l.lstrip()
        if t.startswith('```'):
            in_block = (not in_block) and t.rstrip() == '```console'
            out.append(l); i += 1; continue
        if in_block and l.startswith('$ '):
            cmd_lines = [l]
            while cmd_lines[-1].endswith('\\'):
                i += 1; cmd_lines.append(lines[i])
            i += 1
            exp = []
            while i < len(lines) and not lines[i].startswith('$ ') and not lines[i].lstrip().startswith('```'):
                exp.append(lines[i]); i += 1
            out.extend(cmd_lines)
            cmd = '\n'.join(cmd_lines)[2:]
            patterned = any('...' == e.strip() or '[..]' in e for e in exp) or any(e.startswith('? ') for e in exp)
            if cmd.startswith('dprouter simulate') and not patterned:
                r = subprocess.run(['bash', '-o', 'pipefail', '-c', cmd], cwd=root, env=env, capture_output=True, text=True)
                new = [x.rstrip() for x in r.stdout.split('\n')]
                if new and new[-1] == '': new.pop()
                if r.returncode != 0: print('FAILED', f, cmd[:80], r.stderr[-300:]); new = exp
                if new != exp:
                    changed += 1
                    print(f'{os.path.basename(f)}: {cmd[:100]!r} changed')
                out.extend(new)
            else:
                out.extend(exp)
            continue
        out.append(l); i += 1
    open(f, 'w').write('\n'.join(out))
