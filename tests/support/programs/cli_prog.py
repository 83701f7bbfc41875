import roving
import sys
if __name__ == "__main__":
    with roving.Pool(2) as p:
        print("result", p.map(abs, [-1, -2, 3]), "backend", roving.config.current().backend, sys.argv[1:])
